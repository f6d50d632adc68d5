#!/usr/bin/env bash
# GSM8K recipe: Qwen3-1.7B, GRPO (DAPO preset) on palaestra/GSM8K-v0 (train split).
# GPUs: 4 (one node), colocated: the trainer and 4 SGLang engines (TP 1) share every GPU; the
# engines release their memory while the trainer steps. Sync rollout.
# Command:
#   MODEL=/models/Qwen3-1.7B bash scripts/run_gsm8k_grpo.sh
#   PALAESTRA_BACKEND=megatron bash scripts/run_gsm8k_grpo.sh   # Megatron trainer
#   PALAESTRA_COLOCATE=0 PALAESTRA_GPUS=8 bash scripts/run_gsm8k_grpo.sh   # 4 train + 4 serve
#   bash scripts/run_gsm8k_grpo.sh --dry-run                    # plan only, CPU is enough
#
# Environment (defaults in brackets; the same variables drive the --dry-run placement table):
#   PALAESTRA_GPUS          GPUs of this run                         [4]
#   PALAESTRA_TRAINER_GPUS  GPUs of the trainer                      [4]
#   PALAESTRA_ENGINE_GPUS   GPUs of the SGLang engines               [= trainer when colocated]
#   PALAESTRA_ENGINE_TP     tensor parallelism of one engine         [1]
#   PALAESTRA_COLOCATE      1: trainer and engines share the GPUs    [1]
#   PALAESTRA_BACKEND       torch | megatron (adds --trainer.backend megatron; the TOML keeps
#                           "torch" so it validates on machines without megatron-core) [torch]
#   PALAESTRA_MODEL_SHAPE   named shape for the estimate when the checkpoint is absent
#   PALAESTRA_GPU_MEMORY_GIB memory of one GPU for the estimate (GiB) [139, an H200]
#   MODEL                   checkpoint path (overrides model.path; SGLang serves it too)
#   OUT                     run directory (overrides out)
#   RAY_ADDRESS             join this Ray cluster instead of `ray start --head` (docs/scale_out.md)
#   SGLANG_HOST/SGLANG_PORT first engine address [127.0.0.1:30000]; engine i listens on PORT+i
#   SGLANG_MEM_FRACTION, SGLANG_ARGS, LOG_DIR (server logs, /tmp), PYTHON (python3)
# Further arguments go to `palaestra train` (e.g. --trainer.steps 5 --rollout.mode sync).
# --dry-run validates the config and prints the placement and per-GPU memory plan, then exits
# before Ray or SGLang start (runs on a CPU machine).

DEFAULT_GPUS=4
DEFAULT_TRAINER_GPUS=4
DEFAULT_ENGINE_TP=1
DEFAULT_COLOCATE=1
CONFIG="${CONFIG:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/configs/gsm8k_grpo.toml}"
recipe_args() { :; }
recipe_services() { :; }

source "$(dirname "${BASH_SOURCE[0]}")/recipe_launch.sh"

#!/usr/bin/env bash
# GSM8K recipe: Qwen3-1.7B, GRPO (DAPO preset) on palaestra/GSM8K-v0 (train split).
# Layout: configs/gsm8k_grpo.toml's [placement]: 4 GPUs, colocated: 4 trainer ranks and
# 4 SGLang engines (TP 1) as Ray actors share every GPU (engine i beside trainer rank i); the
# engines release their memory while the trainer steps. Sync rollout.
# Command:
#   MODEL=/models/Qwen3-1.7B bash scripts/run_gsm8k_grpo.sh
#   bash scripts/run_gsm8k_grpo.sh --trainer.backend megatron             # Megatron trainer
#   bash scripts/run_gsm8k_grpo.sh --placement.colocate false \
#     --placement.gpus_per_node 8                                         # 4 train + 4 serve
#   bash scripts/run_gsm8k_grpo.sh --dry-run                              # plan only, CPU is enough
#
# Environment (defaults in brackets):
#   MODEL             checkpoint path (overrides model.path; the engines serve it too)
#   OUT               run directory (overrides out)
#   PALAESTRA_BACKEND torch | megatron: a shorthand of --trainer.backend [torch]
#   RAY_ADDRESS       join this Ray cluster instead of `ray start --head` (docs/scale_out.md)
#   RAY_PORT [6379], RAY_START_ARGS (extra `ray start --head` flags), PYTHON [python3]
# Further arguments go to `palaestra train` (e.g. --trainer.steps 5).
# --dry-run validates the config and prints the placement and per-GPU memory plan, then exits
# before Ray starts (runs on a CPU machine).

CONFIG="${CONFIG:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/configs/gsm8k_grpo.toml}"
recipe_args() { :; }
recipe_services() { :; }

source "$(dirname "${BASH_SOURCE[0]}")/recipe_launch.sh"

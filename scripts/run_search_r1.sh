#!/usr/bin/env bash
# Search-R1 recipe: Qwen2.5-3B-Instruct learns to search (palaestra/SearchR1-v0), GRPO or PPO.
# GPUs: 8 (one node): 4 train, 4 SGLang engines (TP 1), disaggregated, async rollout.
# Command:
#   MODEL=/models/Qwen2.5-3B-Instruct bash scripts/run_search_r1.sh
#   PALAESTRA_ALGO=ppo bash scripts/run_search_r1.sh          # configs/search_r1_ppo.toml
#   PALAESTRA_BACKEND=megatron bash scripts/run_search_r1.sh  # GRPO with the Megatron trainer
#   bash scripts/run_search_r1.sh --dry-run                   # plan only, CPU is enough
# The retriever (`palaestra serve-retriever`, BM25 over the shipped corpus or RETRIEVER_CORPUS)
# starts on RETRIEVER_PORT [8000] unless RETRIEVER_URL points at a running one. Guide:
# docs/search_r1.md.
#
# Environment (defaults in brackets; the same variables drive the --dry-run placement table):
#   PALAESTRA_GPUS          GPUs of this run                         [8]
#   PALAESTRA_TRAINER_GPUS  GPUs of the trainer                      [4]
#   PALAESTRA_ENGINE_GPUS   GPUs of the SGLang engines               [4]
#   PALAESTRA_ENGINE_TP     tensor parallelism of one engine         [1]
#   PALAESTRA_COLOCATE      1: trainer and engines share the GPUs    [0]
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

DEFAULT_GPUS=8
DEFAULT_TRAINER_GPUS=4
DEFAULT_ENGINE_TP=1
DEFAULT_COLOCATE=0
case "${PALAESTRA_ALGO:-grpo}" in
  grpo) CONFIG="${CONFIG:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/configs/search_r1_grpo.toml}" ;;
  ppo)
    CONFIG="${CONFIG:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/configs/search_r1_ppo.toml}" ;;
  *) echo "$0: PALAESTRA_ALGO must be grpo or ppo (got $PALAESTRA_ALGO)" >&2; exit 2 ;;
esac
RETRIEVER_PORT="${RETRIEVER_PORT:-8000}"
RETRIEVER_URL="${RETRIEVER_URL:-}"
recipe_args() {
  local url="${RETRIEVER_URL:-http://127.0.0.1:$RETRIEVER_PORT/retrieve}"
  args+=(--env.kwargs.retriever "\"$url\"")
}
recipe_services() {
  if [[ -z "$RETRIEVER_URL" ]]; then
    palaestra serve-retriever --host 127.0.0.1 --port "$RETRIEVER_PORT" \
      ${RETRIEVER_CORPUS:+--corpus "$RETRIEVER_CORPUS"} > "${LOG_DIR:-/tmp}/retriever.log" 2>&1 &
    pids+=($!)
    wait_http "http://127.0.0.1:$RETRIEVER_PORT/health" 600 "retriever"
  fi
}

source "$(dirname "${BASH_SOURCE[0]}")/recipe_launch.sh"

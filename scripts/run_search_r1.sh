#!/usr/bin/env bash
# Search-R1 recipe: Qwen2.5-3B-Instruct learns to search (palaestra/SearchR1-v0), GRPO or PPO.
# Layout: the config's [placement]: GRPO (configs/search_r1_grpo.toml) 4 trainer ranks and
# 4 SGLang engines (TP 1) on one node of 8 GPUs; PPO (configs/search_r1_ppo.toml) one trainer
# process (policy and critic) and 4 engines. Disaggregated, async rollout.
# Command:
#   MODEL=/models/Qwen2.5-3B-Instruct bash scripts/run_search_r1.sh
#   PALAESTRA_ALGO=ppo bash scripts/run_search_r1.sh          # configs/search_r1_ppo.toml
#   bash scripts/run_search_r1.sh --trainer.backend megatron  # GRPO with the Megatron trainer
#   bash scripts/run_search_r1.sh --dry-run                   # plan only, CPU is enough
# The retriever (`palaestra serve-retriever`, BM25 over the shipped corpus or RETRIEVER_CORPUS)
# starts on RETRIEVER_PORT [8000] unless RETRIEVER_URL points at a running one. Guide:
# docs/search_r1.md.
#
# Environment (defaults in brackets):
#   PALAESTRA_ALGO    grpo | ppo: which config [grpo]
#   MODEL             checkpoint path (overrides model.path; the engines serve it too)
#   OUT               run directory (overrides out)
#   PALAESTRA_BACKEND torch | megatron: a shorthand of --trainer.backend [torch]
#   RAY_ADDRESS       join this Ray cluster instead of `ray start --head` (docs/scale_out.md)
#   RAY_PORT [6379], RAY_START_ARGS (extra `ray start --head` flags), PYTHON [python3]
#   RETRIEVER_URL, RETRIEVER_PORT, RETRIEVER_CORPUS, LOG_DIR (the retriever's log, /tmp)
# Further arguments go to `palaestra train` (e.g. --trainer.steps 5 --rollout.mode sync).
# --dry-run validates the config and prints the placement and per-GPU memory plan, then exits
# before Ray or the retriever start (runs on a CPU machine).

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

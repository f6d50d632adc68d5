# Shared launcher of the GPU recipes (sourced by scripts/run_*.sh after they set their defaults,
# CONFIG, recipe_args and recipe_services). Not meant to be run on its own.

set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
export PALAESTRA_GPUS="${PALAESTRA_GPUS:-$DEFAULT_GPUS}"
export PALAESTRA_COLOCATE="${PALAESTRA_COLOCATE:-$DEFAULT_COLOCATE}"
export PALAESTRA_ENGINE_TP="${PALAESTRA_ENGINE_TP:-$DEFAULT_ENGINE_TP}"
export PALAESTRA_TRAINER_GPUS="${PALAESTRA_TRAINER_GPUS:-$DEFAULT_TRAINER_GPUS}"
if [[ "$PALAESTRA_COLOCATE" == 1 ]]; then
  export PALAESTRA_ENGINE_GPUS="${PALAESTRA_ENGINE_GPUS:-$PALAESTRA_TRAINER_GPUS}"
else
  export PALAESTRA_ENGINE_GPUS="${PALAESTRA_ENGINE_GPUS:-$((PALAESTRA_GPUS - PALAESTRA_TRAINER_GPUS))}"
fi
SGLANG_HOST="${SGLANG_HOST:-127.0.0.1}"
SGLANG_PORT="${SGLANG_PORT:-30000}"

dry_run=0
for arg in "$@"; do [[ "$arg" == --dry-run ]] && dry_run=1; done

if (( PALAESTRA_ENGINE_GPUS < 1 || PALAESTRA_ENGINE_GPUS % PALAESTRA_ENGINE_TP )); then
  echo "$0: PALAESTRA_ENGINE_GPUS ($PALAESTRA_ENGINE_GPUS) must be a positive multiple of" \
       "PALAESTRA_ENGINE_TP ($PALAESTRA_ENGINE_TP)" >&2
  exit 2
fi
num_engines=$((PALAESTRA_ENGINE_GPUS / PALAESTRA_ENGINE_TP))
urls=""
for ((i = 0; i < num_engines; i++)); do
  urls+="${urls:+, }\"http://$SGLANG_HOST:$((SGLANG_PORT + i))\""
done

args=(--engine.urls "[$urls]")
[[ -n "${MODEL:-}" ]] && args+=(--model.path "$MODEL")
[[ -n "${OUT:-}" ]] && args+=(--out "$OUT")
case "${PALAESTRA_BACKEND:-torch}" in
  torch) ;;
  megatron) args+=(--trainer.backend megatron) ;;
  *) echo "$0: PALAESTRA_BACKEND must be torch or megatron (got $PALAESTRA_BACKEND)" >&2; exit 2 ;;
esac
recipe_args  # per-recipe extra overrides (defined above)

if (( dry_run )); then
  # validate the config and print the placement + memory plan; start nothing
  exec palaestra train "$CONFIG" "${args[@]}" "$@"
fi

# ---- from here on a GPU node: Ray, SGLang servers, then the trainer ----
pids=()
started_ray=0
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  if (( started_ray )); then ray stop >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

wait_http() {  # wait_http URL SECONDS NAME
  local deadline=$((SECONDS + $2))
  until curl -sf "$1" >/dev/null 2>&1; do
    if (( SECONDS > deadline )); then echo "$0: $3 not up at $1 after $2 s" >&2; exit 1; fi
    sleep 5
  done
}

if [[ -z "${RAY_ADDRESS:-}" ]]; then
  ray start --head --num-gpus "$PALAESTRA_GPUS" --port "${RAY_PORT:-6379}" --disable-usage-stats
  started_ray=1
  export RAY_ADDRESS="127.0.0.1:${RAY_PORT:-6379}"
fi
args+=(--rollout.ray_address "$RAY_ADDRESS")

model_path="${MODEL:-$("$PYTHON" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["model"]["path"])' "$CONFIG")}"
recipe_services  # per-recipe services (retriever, ...) (defined above)

first_engine_gpu=$PALAESTRA_TRAINER_GPUS
mem_fraction="${SGLANG_MEM_FRACTION:-0.85}"
extra_sglang=()
if [[ "$PALAESTRA_COLOCATE" == 1 ]]; then
  # shared GPUs: the engine releases its memory while the trainer steps (memory saver)
  first_engine_gpu=0
  mem_fraction="${SGLANG_MEM_FRACTION:-0.45}"
  extra_sglang+=(--enable-memory-saver)
fi
for ((i = 0; i < num_engines; i++)); do
  first=$((first_engine_gpu + i * PALAESTRA_ENGINE_TP))
  gpus=$(seq -s, "$first" $((first + PALAESTRA_ENGINE_TP - 1)))
  CUDA_VISIBLE_DEVICES="$gpus" "$PYTHON" -m sglang.launch_server \
    --model-path "$model_path" --host "$SGLANG_HOST" --port $((SGLANG_PORT + i)) \
    --tp-size "$PALAESTRA_ENGINE_TP" --mem-fraction-static "$mem_fraction" \
    "${extra_sglang[@]}" ${SGLANG_ARGS:-} > "${LOG_DIR:-/tmp}/sglang_$i.log" 2>&1 &
  pids+=($!)
done
for ((i = 0; i < num_engines; i++)); do
  wait_http "http://$SGLANG_HOST:$((SGLANG_PORT + i))/health" 900 "SGLang server $i"
done

palaestra train "$CONFIG" "${args[@]}" "$@"

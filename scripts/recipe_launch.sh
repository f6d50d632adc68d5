# Shared launcher of the GPU recipes (sourced by scripts/run_*.sh after they set CONFIG,
# recipe_args and recipe_services). Not meant to be run on its own.
#
# The layout of a run is its config's [placement] section: `palaestra train` starts the trainer
# group (one Ray actor per trainer rank) and the engines (one Ray actor per SGLang server) on
# the plan's bundles. This script only starts Ray (or joins RAY_ADDRESS), the recipe's services
# (a retriever, ...) and `palaestra train CONFIG`; change the layout with dotted overrides
# (`--placement.trainer_ranks 8 --placement.nodes 2`), never with environment variables.

set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"

dry_run=0
for arg in "$@"; do [[ "$arg" == --dry-run ]] && dry_run=1; done

args=()
[[ -n "${MODEL:-}" ]] && args+=(--model.path "$MODEL")
[[ -n "${OUT:-}" ]] && args+=(--out "$OUT")
case "${PALAESTRA_BACKEND:-torch}" in  # a shorthand of --trainer.backend
  torch) ;;
  megatron) args+=(--trainer.backend megatron) ;;
  *) echo "$0: PALAESTRA_BACKEND must be torch or megatron (got $PALAESTRA_BACKEND)" >&2; exit 2 ;;
esac

# the layout variables of earlier versions: still honoured once, as the override they stand for
deprecated() {  # deprecated VAR FLAG [VALUE]
  local var="$1" flag="$2" value="${3:-${!1}}"
  echo "$0: $var is deprecated: the layout is the config's [placement] section; passing" \
       "$flag $value (use that flag instead)" >&2
  args+=("$flag" "$value")
  unset "$var"
}
[[ -n "${PALAESTRA_GPUS:-}" ]] && deprecated PALAESTRA_GPUS --placement.gpus_per_node
[[ -n "${PALAESTRA_GPUS_PER_NODE:-}" ]] && deprecated PALAESTRA_GPUS_PER_NODE --placement.gpus_per_node
[[ -n "${PALAESTRA_TRAINER_GPUS:-}" ]] && deprecated PALAESTRA_TRAINER_GPUS --placement.trainer_ranks
[[ -n "${PALAESTRA_ENGINE_GPUS:-}" ]] && deprecated PALAESTRA_ENGINE_GPUS --placement.engine_gpus
[[ -n "${PALAESTRA_ENGINE_TP:-}" ]] && deprecated PALAESTRA_ENGINE_TP --placement.engine_tp
if [[ -n "${PALAESTRA_COLOCATE:-}" ]]; then
  case "$PALAESTRA_COLOCATE" in
    1|true|yes) deprecated PALAESTRA_COLOCATE --placement.colocate true ;;
    *) deprecated PALAESTRA_COLOCATE --placement.colocate false ;;
  esac
fi
[[ -n "${PALAESTRA_MODEL_SHAPE:-}" ]] && deprecated PALAESTRA_MODEL_SHAPE --placement.model_shape
[[ -n "${PALAESTRA_GPU_MEMORY_GIB:-}" ]] && deprecated PALAESTRA_GPU_MEMORY_GIB --placement.gpu_memory_gib
for var in SGLANG_HOST SGLANG_PORT SGLANG_MEM_FRACTION SGLANG_ARGS; do
  if [[ -n "${!var:-}" ]]; then
    echo "$0: $var is no longer read: the engines are Ray actors of [placement] that pick" \
         "their own ports; pass server flags as --engine.launch_args '[\"--flag\", \"value\"]'" >&2
    exit 2
  fi
done
recipe_args  # per-recipe extra overrides (defined by the run_*.sh script)

if (( dry_run )); then
  # validate the config and print the placement + memory plan; start nothing
  exec palaestra train "$CONFIG" "${args[@]}" "$@"
fi

# ---- from here on a GPU node: Ray, the recipe's services, then the run ----
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

if [[ -z "${RAY_ADDRESS:-}" ]]; then  # a one-node cluster of this machine's GPUs
  ray start --head --port "${RAY_PORT:-6379}" --disable-usage-stats ${RAY_START_ARGS:-}
  started_ray=1
  export RAY_ADDRESS="127.0.0.1:${RAY_PORT:-6379}"
fi
args+=(--rollout.ray_address "$RAY_ADDRESS")

recipe_services  # per-recipe services (retriever, ...) (defined by the run_*.sh script)

palaestra train "$CONFIG" "${args[@]}" "$@"

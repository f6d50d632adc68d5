#!/usr/bin/env bash
# Code recipe: Qwen2.5-7B-Instruct, GRPO on palaestra/Code-v0 (MBPP train split, sandboxed tests).
# Layout: configs/code_grpo.toml's [placement]: one node of 8 GPUs, 4 trainer ranks and
# 2 SGLang engines x TP 2 as Ray actors, disaggregated, async rollout.
# Needs the sandbox on the node (bubblewrap; scripts/setup.sh).
# Command:
#   MODEL=/models/Qwen2.5-7B-Instruct bash scripts/run_code_grpo.sh
#   bash scripts/run_code_grpo.sh --trainer.backend megatron          # Megatron trainer
#   bash scripts/run_code_grpo.sh --placement.nodes 2 --placement.trainer_ranks 8 \
#     --placement.engine_gpus 8                                       # two nodes (RAY_ADDRESS)
#   bash scripts/run_code_grpo.sh --dry-run                           # plan only, CPU is enough
#
# Environment (defaults in brackets):
#   MODEL             checkpoint path (overrides model.path; the engines serve it too)
#   OUT               run directory (overrides out)
#   PALAESTRA_BACKEND torch | megatron: a shorthand of --trainer.backend [torch]
#   RAY_ADDRESS       join this Ray cluster instead of `ray start --head` (docs/scale_out.md)
#   RAY_PORT [6379], RAY_START_ARGS (extra `ray start --head` flags), PYTHON [python3]
# Further arguments go to `palaestra train` (e.g. --trainer.steps 5 --placement.trainer_ranks 2).
# --dry-run validates the config and prints the placement and per-GPU memory plan, then exits
# before Ray starts (runs on a CPU machine).

CONFIG="${CONFIG:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/configs/code_grpo.toml}"
recipe_args() { :; }
recipe_services() { :; }

source "$(dirname "${BASH_SOURCE[0]}")/recipe_launch.sh"

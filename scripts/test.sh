#!/usr/bin/env bash
# The test command of README.md: installs palaestra in .venv, then runs the CPU test suite.
#   bash scripts/test.sh [pytest args...]
# GPU tests carry the `gpu` marker and skip cleanly without CUDA; `docker` tests skip (with the
# reason) where no Docker engine runs. pytest's exit code 5 (nothing collected) counts as success.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
VENV=${PALAESTRA_VENV:-.venv}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$VENV/bin/python" -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then rc=0; fi
exit "$rc"

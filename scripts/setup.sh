#!/usr/bin/env bash
# Creates (or reuses) the virtual environment .venv with palaestra and its CPU dependencies.
#   bash scripts/setup.sh            # then: source .venv/bin/activate
# CPU torch comes from `pip install torch==2.13.0` (a CPU build on this machine kind); the
# sglang extra is never installed here (it replaces CPU torch with a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PALAESTRA_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
"$VENV/bin/python" -m pip install -q "torch==2.13.0" || "$VENV/bin/python" -m pip install -q "torch>=2.4"
"$VENV/bin/python" -m pip install -q -e ".[ray,docker,sandbox,data,dev]"
echo "palaestra installed in $VENV (activate with: source $VENV/bin/activate)"

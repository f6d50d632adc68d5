#!/usr/bin/env bash
# Creates (or reuses) the virtual environment .venv with palaestra and its CPU dependencies,
# and installs bubblewrap (the local sandbox's launcher) when it is missing.
#   bash scripts/setup.sh            # then: source .venv/bin/activate
# CPU torch comes from `pip install torch==2.13.0` (a CPU build on this machine kind); the
# sglang extra is never installed here (it replaces CPU torch with a CUDA build).
# Idempotent and fast when nothing changed: the pip step is skipped while pyproject.toml and
# this script are unchanged since the last successful install (PALAESTRA_SETUP_FORCE=1 redoes it).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PALAESTRA_VENV:-.venv}

# 1. bubblewrap. Never fatal: without it the sandbox uses `unshare` (same guarantees as root)
#    or refuses to start, saying why; `palaestra sandbox doctor` shows what is in force.
install_bubblewrap() {
  if command -v bwrap >/dev/null 2>&1; then
    return 0
  fi
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "note: bubblewrap is not installed; install it for the sandbox" \
         "(Debian/Ubuntu: sudo apt-get install bubblewrap)" >&2
    return 0
  fi
  local log
  log=$(mktemp /tmp/palaestra-apt.XXXXXX.log)
  echo "installing bubblewrap for the sandbox (apt-get, log: $log)"
  if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends bubblewrap) >"$log" 2>&1 \
      && command -v bwrap >/dev/null 2>&1; then
    echo "bubblewrap installed: $(bwrap --version)"
  else
    echo "warning: could not install bubblewrap (see $log); the sandbox falls back to" \
         "unshare. Fix: apt-get install bubblewrap" >&2
  fi
}
install_bubblewrap || true

# 2. the virtual environment
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
STAMP="$VENV/.palaestra-setup-stamp"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -z "${PALAESTRA_SETUP_FORCE:-}" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
    && "$VENV/bin/python" -c "import palaestra" >/dev/null 2>&1; then
  echo "palaestra already installed in $VENV (up to date; PALAESTRA_SETUP_FORCE=1 reinstalls)"
  exit 0
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
"$VENV/bin/python" -m pip install -q "torch==2.13.0" || "$VENV/bin/python" -m pip install -q "torch>=2.4"
# verifiers and openenv: the ecosystem adapters' libraries, so their tests run against the real
# packages (verifiers 0.4 pins mcp==2.0.0 and openai<3, which the rest of the set accepts)
"$VENV/bin/python" -m pip install -q -e ".[ray,docker,sandbox,data,mcp,verifiers,openenv,lora,gguf,tinker,dev]"
echo "$want" >"$STAMP"
echo "palaestra installed in $VENV (activate with: source $VENV/bin/activate)"

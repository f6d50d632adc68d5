#!/usr/bin/env bash
# The test command of README.md: installs palaestra in .venv, type-checks the package (mypy,
# [tool.mypy] of pyproject.toml: zero errors), then runs the CPU test suite.
#   bash scripts/test.sh [pytest args...]
# PALAESTRA_SKIP_TYPECHECK=1 skips the type check (a quick run of a few tests).
# The default leaves out the tests marked `slow` (whole training runs of more than ~20 s on the
# 2-core machine: the CPU suite stays within minutes on any machine of this kind);
# PALAESTRA_SLOW=1 runs them too (the full suite), PALAESTRA_SLOW=only runs them alone.
# GPU tests carry the `gpu` marker and skip cleanly without CUDA; `docker` tests skip (with the
# reason) where no Docker engine runs. pytest's exit code 5 (nothing collected) counts as success.
# Then the `numerics` tests run once more with torch held to AVX2 (PALAESTRA_AVX2_PASS=0 skips).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
VENV=${PALAESTRA_VENV:-.venv}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
typecheck=0
if [ "${PALAESTRA_SKIP_TYPECHECK:-0}" != 1 ]; then
  "$VENV/bin/python" -m mypy || typecheck=$?
fi
case "${PALAESTRA_SLOW:-0}" in
  1) select=() ;;
  only) select=(-m slow) ;;
  *) select=(-m "not slow") ;;
esac
"$VENV/bin/python" -m pytest -q "${select[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then rc=0; fi
# A second pass of the tests marked `numerics` with torch held to AVX2 (its ATen kernels, MKL's
# and oneDNN's): the float paths of a CPU without AVX-512, seen from this one (docs/testing.md
# says what that does and does not catch). Not when pytest arguments choose the tests, nor with
# PALAESTRA_SLOW=only or PALAESTRA_AVX2_PASS=0.
if [ "$rc" -eq 0 ] && [ $# -eq 0 ] && [ "${PALAESTRA_SLOW:-0}" != only ] \
    && [ "${PALAESTRA_AVX2_PASS:-1}" != 0 ]; then
  echo "numerics pass: the tests marked numerics again, torch held to AVX2"
  ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "numerics and not slow and not gpu"
  rc=$?
  if [ "$rc" -eq 5 ]; then rc=0; fi
fi
if [ "$rc" -eq 0 ] && [ "$typecheck" -ne 0 ]; then
  echo "type check failed (mypy above): fix the errors or run with PALAESTRA_SKIP_TYPECHECK=1" >&2
  rc=$typecheck
fi
exit "$rc"

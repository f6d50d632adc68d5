#!/usr/bin/env bash
# Build (or reuse, if unchanged) the Docker image used by DockerSandbox. No registry needed:
# the image is a minimal root filesystem made from this machine's /usr/bin/python3 (standard
# library, a shell, core utilities and the shared libraries they load), `docker import`ed.
#
#   scripts/build_sandbox_image.sh                 # -> palaestra-sandbox:py3 (cached by content hash)
#   scripts/build_sandbox_image.sh --force         # rebuild
#   scripts/build_sandbox_image.sh --tag NAME:TAG
#
# Needs a running Docker engine (e.g. `dockerd --bridge=none --iptables=false &`) and the
# docker SDK (pip install 'palaestra[docker]').
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m palaestra.sandbox.docker_image build "$@"

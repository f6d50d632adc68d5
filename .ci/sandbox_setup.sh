#!/usr/bin/env bash
# CI preparation for the sandbox tests (called by .ci/run before pytest).
#
# 1. installs bubblewrap and docker.io from Debian if missing (root + apt-get only),
# 2. starts `dockerd --bridge=none --iptables=false` in the background if no engine answers
#    (no bridge network, no firewall rules; log in /tmp/dockerd.log) and waits up to 60 s,
# 3. builds or reuses the local sandbox image (scripts/build_sandbox_image.sh),
# 4. prints `palaestra sandbox doctor`.
# It never fails the CI: whatever cannot be set up makes the `docker` tests skip with the reason.
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
log() { echo "[sandbox_setup] $*"; }

engine_up() {
    "$PY" - <<'PY' >/dev/null 2>&1
import docker
docker.from_env(timeout=5).ping()
PY
}

missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        log "installing ${missing[*]}"
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --no-install-recommends "${missing[@]}") \
            || log "apt-get install failed; continuing without ${missing[*]}"
    else
        log "cannot install ${missing[*]} (needs root and apt-get)"
    fi
fi

if ! "$PY" -c "import docker" >/dev/null 2>&1; then
    log "docker SDK missing: pip install 'palaestra[docker]'; docker tests will skip"
elif engine_up; then
    log "docker engine already running"
elif command -v dockerd >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    log "starting dockerd --bridge=none --iptables=false (log: /tmp/dockerd.log)"
    nohup dockerd --bridge=none --iptables=false >/tmp/dockerd.log 2>&1 &
    for _ in $(seq 1 60); do
        engine_up && break
        sleep 1
    done
    engine_up && log "docker engine is up" || log "dockerd did not come up; docker tests will skip"
else
    log "no docker engine and cannot start one; docker tests will skip"
fi

if engine_up; then
    scripts/build_sandbox_image.sh || log "image build failed; docker tests will skip"
fi

"$PY" -m palaestra.cli sandbox doctor || log "sandbox doctor reported a problem (see above)"
exit 0

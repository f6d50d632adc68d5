"""Helpers shared by the sandbox tests (host-side process checks, Docker availability)."""

from __future__ import annotations

import contextlib
import functools
import os

import pytest

#: secret planted in the host environment while the sandboxes under test run
HOST_SECRET = "palaestra-host-secret-5f1e"
SECRET_VARS = ("PALAESTRA_TEST_SECRET", "AWS_SECRET_ACCESS_KEY")


@contextlib.contextmanager
def planted_secrets():
    """Put ``HOST_SECRET`` into the host environment, restoring it afterwards."""
    saved = {k: os.environ.get(k) for k in SECRET_VARS}
    os.environ.update({k: HOST_SECRET for k in SECRET_VARS})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
@functools.lru_cache(maxsize=1)
def docker_status() -> tuple[bool, str]:
    """(usable, reason) for the Docker backend on this machine."""
    try:
        import docker
    except ImportError:
        return False, "docker SDK not installed (pip install 'palaestra[docker]')"
    try:
        client = docker.from_env(timeout=10)
        client.ping()
    except Exception as exc:
        return False, f"no Docker engine reachable ({type(exc).__name__}); run .ci/sandbox_setup.sh"
    from palaestra.sandbox.config import DEFAULT_IMAGE

    try:
        client.images.get(DEFAULT_IMAGE)
    except Exception:
        return False, f"image {DEFAULT_IMAGE} missing; run scripts/build_sandbox_image.sh"
    finally:
        client.close()
    return True, ""


def requires_docker() -> pytest.MarkDecorator:
    ok, reason = docker_status()
    return pytest.mark.skipif(not ok, reason=reason)


def host_processes_matching(marker: str) -> list[int]:
    """Host pids whose command line contains ``marker`` (sandboxed ones included)."""
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if marker.encode() in fh.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def processes_with_uid_in(lo: int, hi: int) -> list[int]:
    """Host pids whose real uid lies in [lo, hi) (a local sandbox's per-run uid block)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as fh:
                for line in fh:
                    if line.startswith("Uid:"):
                        if lo <= int(line.split()[1]) < hi:
                            found.append(int(entry))
                        break
        except OSError:
            continue
    return found

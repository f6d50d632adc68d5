"""Stopping the server processes palaestra launches (SGLang, the retriever) in their own group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (one of another user's counts: it exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def terminate_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group led by ``proc``, SIGKILL it after ``grace_s``; idempotent.

    The group (``start_new_session=True`` at launch) takes the server's own children with it.
    """
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

"""Turn the agent's ``done`` frame into an ``ExecResult`` (shared by every backend)."""

from __future__ import annotations

import os
from typing import Any

from palaestra.sandbox.result import ExecResult, decode_output

SETUP_FAILED_EXIT = 126
SETUP_FAILED_PREFIX = "palaestra sandbox: "
RESTART_NOTE = ("[palaestra: the python interpreter was restarted (the previous one was killed); "
                "earlier variables are gone, files are kept]\n")


def result_from_frame(header: dict[str, Any], blobs: list[bytes]) -> ExecResult:
    """Exit status (shell convention), flags and capped, decoded output of one run."""
    if header.get("op") == "error":
        return ExecResult.failure(str(header.get("error", "unknown sandbox error")))
    status = header.get("status")
    killed_by: int | None = None
    if isinstance(status, int):
        if os.WIFSIGNALED(status):
            killed_by = os.WTERMSIG(status)
            exit_code = 128 + killed_by
        else:
            exit_code = os.WEXITSTATUS(status)
    else:
        exit_code = int(header.get("exit_code") or 0)
    timed_out = bool(header.get("timed_out"))
    cancelled = bool(header.get("cancelled"))
    out = blobs[0] if blobs else b""
    err = blobs[1] if len(blobs) > 1 else b""
    stdout, trunc_out = decode_output(out, int(header.get("out_size", len(out))))
    stderr, trunc_err = decode_output(err, int(header.get("err_size", len(err))))
    error = None
    if exit_code == SETUP_FAILED_EXIT and stderr.startswith(SETUP_FAILED_PREFIX):
        error = stderr.strip()[len(SETUP_FAILED_PREFIX):]
    elif cancelled:
        error = "run cancelled"
    if header.get("restarted"):
        stderr = RESTART_NOTE + stderr
    # The python runner turns MemoryError into SIGKILL (137, like the kernel OOM killer and
    # Docker) and flags it; in containers the cgroup's OOM-kill counter is checked as well.
    oom = bool(header.get("oom")) and not timed_out and not cancelled
    cpu = header.get("cpu")
    rss = header.get("maxrss_kb")
    return ExecResult(stdout=stdout, stderr=stderr, exit_code=exit_code, timed_out=timed_out,
                      duration_s=float(header.get("duration", 0.0)), oom_killed=oom, error=error,
                      truncated=trunc_out or trunc_err,
                      cpu_s=float(cpu) if cpu is not None else None,
                      max_rss_mb=float(rss) / 1024 if rss is not None else None)

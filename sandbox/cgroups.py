"""A pids cgroup around one local sandbox: a hard cap on its processes (root hosts only).

Per-run uids already bound a fork bomb through RLIMIT_NPROC; this cap also holds where runs keep
uid 0 (``per_run_uid=False``) and bounds the sandbox as a whole. Best effort: where no pids
controller is writable the sandbox runs without it and ``doctor`` says so.
"""

from __future__ import annotations

import os
import shlex
import time
import uuid

V1_ROOT = "/sys/fs/cgroup/pids"
V2_ROOT = "/sys/fs/cgroup"


class PidsCgroup:
    """One freshly made cgroup with ``pids.max`` set; processes join it through ``wrap``."""

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def create(cls, limit: int) -> PidsCgroup | None:
        """Make the cgroup, or None where no writable pids controller exists."""
        for root in cls._candidate_roots():
            cls._remove_stale(root)
            path = os.path.join(root, f"palaestra-sandbox-{uuid.uuid4().hex[:12]}")
            try:
                os.mkdir(path, 0o755)
            except OSError:
                continue
            try:
                with open(os.path.join(path, "pids.max"), "w") as fh:
                    fh.write(str(int(limit)))
                return cls(path)
            except OSError:
                try:
                    os.rmdir(path)
                except OSError:
                    pass
        return None

    @staticmethod
    def _remove_stale(root: str, min_age_s: float = 3600.0) -> None:
        """Empty cgroups of sandboxes whose owner died without closing them (rmdir refuses
        while any process is inside; the age check spares sandboxes that are just starting)."""
        try:
            names = [n for n in os.listdir(root) if n.startswith("palaestra-sandbox-")]
        except OSError:
            return
        now = time.time()
        for name in names:
            path = os.path.join(root, name)
            try:
                if now - os.stat(path).st_mtime > min_age_s:
                    os.rmdir(path)
            except OSError:
                continue

    @staticmethod
    def _candidate_roots() -> list[str]:
        roots = []
        if os.path.isdir(V1_ROOT) and os.access(V1_ROOT, os.W_OK):
            roots.append(V1_ROOT)
        try:
            with open(os.path.join(V2_ROOT, "cgroup.subtree_control")) as fh:
                if "pids" in fh.read().split() and os.access(V2_ROOT, os.W_OK):
                    roots.append(V2_ROOT)
        except OSError:
            pass
        return roots

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run by a shell that first moves itself into the cgroup (then ``exec``s), so
        every process started later is born inside it."""
        procs = shlex.quote(os.path.join(self.path, "cgroup.procs"))
        return ["/bin/sh", "-c", f'echo $$ > {procs} && exec "$@"', "palaestra-sandbox", *argv]

    def remove(self, timeout: float = 5.0) -> None:
        """Delete the cgroup once its processes are gone (they are killed by then)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.02)

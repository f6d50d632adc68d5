"""Probe which isolation layers work on this machine (``palaestra sandbox doctor`` prints it).

Each layer is tried for real (bubblewrap and ``unshare`` run ``true`` in a new network
namespace; Landlock reports its ABI; the seccomp filter is compiled), never guessed from
version numbers. The result is cached per process.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

from palaestra.sandbox.isolation import unshare_argv


@dataclass(frozen=True)
class IsolationReport:
    """What the local backend can use here, strongest launcher first."""

    root: bool
    bwrap: str | None
    bwrap_version: str | None
    unshare: str | None
    landlock_abi: int
    seccomp: bool
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def network_isolation(self) -> str | None:
        """The launcher that gives runs their own network namespace, or None."""
        if self.bwrap:
            return "bwrap"
        if self.unshare:
            return "unshare"
        return None

    @property
    def per_run_uid(self) -> bool:
        """Runs can get their own unprivileged uid (needs root)."""
        return self.root

    def layers(self) -> list[str]:
        """Human-readable names of the layers that will be in force by default."""
        out = []
        if self.network_isolation == "bwrap":
            out.append("bubblewrap namespaces (mount, net, pid, ipc, uts)")
        elif self.network_isolation == "unshare":
            out.append("unshare namespaces (net, pid, ipc, uts, mount)")
        if self.landlock_abi:
            parts = ["filesystem"]
            if self.landlock_abi >= 4:
                parts.append("tcp")
            if self.landlock_abi >= 6:
                parts.append("signal+abstract-socket scoping")
            out.append(f"landlock ABI {self.landlock_abi} ({', '.join(parts)})")
        if self.seccomp:
            out.append("seccomp filter (no inet sockets, no ptrace/mount/ns/bpf/io_uring)")
        out.append("rlimits (cpu, address space, processes, file size, open files)")
        if self.per_run_uid:
            out.append("per-run unprivileged uid")
        out.append("per-run pid namespace with its own /proc (hidepid) and workspace tmpfs quota")
        out.append("scrubbed environment, fresh working directory, output caps")
        return out

    def format(self) -> str:
        """A small table for the terminal."""
        rows = [
            ("running as root", "yes" if self.root else "no"),
            ("bubblewrap", f"{self.bwrap} ({self.bwrap_version})" if self.bwrap else "unusable"),
            ("unshare --net", self.unshare or "unusable"),
            ("landlock ABI", str(self.landlock_abi) if self.landlock_abi else "unavailable"),
            ("seccomp (pyseccomp)", "yes" if self.seccomp else "unavailable"),
            ("network isolation", self.network_isolation or "NONE (sandbox refuses to start)"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        lines.append("default layers:")
        lines += [f"  - {layer}" for layer in self.layers()]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _works(argv: list[str]) -> tuple[bool, str]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=20,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        return False, str(exc)
    return proc.returncode == 0, (proc.stderr or proc.stdout).strip()


@functools.lru_cache(maxsize=1)
def probe_isolation() -> IsolationReport:
    """Try every layer once (about 30 ms) and report what works."""
    from palaestra.sandbox.inner.linux import landlock_abi
    from palaestra.sandbox.seccomp import build_filter_bpf

    notes: list[str] = []
    root = os.geteuid() == 0
    bwrap = shutil.which("bwrap")
    version = None
    if bwrap:
        ok, msg = _works([bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--unshare-net",
                          "--unshare-pid", "--die-with-parent", "true"])
        if ok:
            version = subprocess.run([bwrap, "--version"], capture_output=True,
                                     text=True).stdout.strip()
        else:
            notes.append(f"bubblewrap present but failed: {msg[:200]}")
            bwrap = None
    else:
        notes.append("bubblewrap not installed (Debian/Ubuntu: apt-get install bubblewrap)")
    unshare = shutil.which("unshare")
    if unshare:
        ok, msg = _works(unshare_argv(unshare, root) + ["true"])
        if not ok:
            notes.append(f"unshare cannot make namespaces here: {msg[:200]}")
            unshare = None
    try:
        abi = landlock_abi()
    except OSError:
        abi = 0
    if not abi:
        notes.append("landlock unavailable: filesystem confinement relies on bubblewrap")
    seccomp = bool(build_filter_bpf())
    if not seccomp:
        notes.append("pyseccomp/libseccomp unavailable: pip install 'palaestra[sandbox]'")
    return IsolationReport(root=root, bwrap=bwrap, bwrap_version=version, unshare=unshare,
                           landlock_abi=abi, seccomp=seccomp, notes=tuple(notes))


def describe_mode(mode: dict[str, Any]) -> list[str]:
    """The layers a started local sandbox has in force (its ``mode``), one line each."""
    out = [f"launcher: {mode.get('launcher')}"]
    out.append("uid separation: each run its own unprivileged uid" if mode.get("per_run_uid")
               else "uid separation: NO, runs keep the sandbox's uid (per-run uids need root)")
    out.append("pid namespace: each run its own (the run is pid 2; pid 1 reaps and reports)"
               if mode.get("per_run_pidns") else
               "pid namespace: NOT per run (per_run_pid_namespace=False)")
    out.append("/proc: private per run (own pid namespace, hidepid=invisible)"
               if mode.get("private_proc") else "/proc: shared by the runs of one worker")
    quota = mode.get("workspace_quota_mb")
    out.append(f"workspace quota: {quota} MiB tmpfs per run and per session" if quota
               else "workspace quota: NONE per session (one tmpfs shared by all runs)")
    if mode.get("exposed"):
        out.append(f"closed directories re-exposed for per-run uids: {mode['exposed']}")
    abi = mode.get("landlock_abi")
    out.append(f"landlock ABI {abi}" if abi else "landlock: NONE")
    out.append("seccomp filter" if mode.get("seccomp") else "seccomp: NONE")
    out.append(f"pids cgroup: {mode['pids_cgroup']}" if mode.get("pids_cgroup")
               else "pids cgroup: none (per-uid RLIMIT_NPROC only)")
    return out

"""The requests the host sends a zygote, built in one place for both backends.

``ZygoteRequests`` turns a ``RunSpec`` plus where it runs (working directory, uid) into the
``(header, blobs)`` frame the in-sandbox runtime expects, with the limits of the sandbox's
config. The local and Docker backends differ only in the arguments (paths, uids, whether
RLIMIT_NPROC means anything), never in the frame layout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from palaestra.sandbox.spec import RunSpec
from palaestra.sandbox.config import SandboxConfig
from palaestra.sandbox.errors import SandboxFileError
from palaestra.sandbox.inner.framing import pack

MIB = 1024 * 1024
#: The CPU limit of a fork when no ``session_cpu_seconds`` is set: that of a longest cell.
MAX_CELL_S = 600.0
Header = dict[str, Any]
Frame = tuple[Header, list[bytes]]


@dataclass(frozen=True)
class ZygoteRequests:
    """Request frames for a zygote of a sandbox with ``config``.

    ``count_processes``: RLIMIT_NPROC counts every process of a uid, so it is set only where
    each run or session has a uid of its own (elsewhere a pids cgroup bounds processes).
    """

    config: SandboxConfig
    count_processes: bool

    def limits(self, timeout: float, *, session: bool = False) -> dict[str, int | None]:
        """Per-run rlimits; a session cell's CPU limit is ``session_cpu_seconds``."""
        cfg = self.config
        cpu = cfg.session_cpu_seconds if session else None
        return {"cpu": int(cpu) if cpu else cfg.cpu_limit(timeout), "as": cfg.memory_mb * MIB,
                "fsize": cfg.max_file_size_mb * MIB, "nofile": cfg.max_open_files,
                "nproc": cfg.max_processes if self.count_processes else None}

    @staticmethod
    def init(opts: dict[str, Any], seccomp_bpf: bytes) -> bytes:
        """The first frame: the final options and the seccomp filter (its only blob)."""
        return pack({"op": "init", "opts": opts}, [seccomp_bpf])

    def run(self, spec: RunSpec, *, workdir: str, uid: int | None, create_workdir: bool,
            private_workdir: bool = False, shared_uid: bool = False) -> Frame:
        """A ``run``: a header of what the zygote needs (limits, paths, uid) and the payload it
        must never read, only hand to the run as a memfd: a meta blob (code, argv, file
        names), the files, then stdin. ``shared_uid``: other sessions (a forked family) run
        with ``uid`` too, so the zygote must never kill by uid for this run."""
        meta = json.dumps({"code": spec.code, "argv": list(spec.argv),
                           "files": [name for name, _ in spec.files]}).encode()
        blobs = [meta, *(data for _, data in spec.files)]
        if spec.stdin is not None:
            blobs.append(spec.stdin)
        header = {"op": "run", "kind": spec.kind, "has_stdin": spec.stdin is not None,
                  "timeout": spec.timeout, "workdir": workdir, "create_workdir": create_workdir,
                  "uid": uid, "private_workdir": private_workdir,
                  "limits": self.limits(spec.timeout)}
        if shared_uid:
            header["shared_uid"] = True
        return header, blobs

    def cell(self, spec: RunSpec, *, session: str, had_kernel: bool, workdir: str,
             uid: int | None, nursery: str | None = None, shared_uid: bool = False) -> Frame:
        """A ``cell`` of a persistent session: payload blobs code, then stdin. ``nursery``:
        where the interpreter's forks get their workspaces (it may reach it, not write it)."""
        blobs = [spec.code.encode("utf-8", "surrogateescape")]
        if spec.stdin is not None:
            blobs.append(spec.stdin)
        header = {"op": "cell", "kind": "kernel", "has_stdin": spec.stdin is not None,
                  "timeout": spec.timeout, "session": session, "had_kernel": had_kernel,
                  "uid": uid, "workdir": workdir, "create_workdir": False,
                  "limits": self.limits(spec.timeout, session=True)}
        if nursery is not None:
            header["nursery"] = nursery
        if shared_uid:
            header["shared_uid"] = True
        return header, blobs

    def fork(self, session: str, child: str, *, workdir: str, nursery: str,
             parent_nursery: str) -> Header:
        """Fork the interpreter of ``session`` as ``child`` (workspace copied to ``workdir``);
        the parent's further forks go below ``parent_nursery``."""
        return {"op": "fork", "session": session, "child": child, "workdir": workdir,
                "nursery": nursery, "parent_nursery": parent_nursery,
                "limits": self.limits(MAX_CELL_S, session=True)}

    def read_file(self, root: str, path: str) -> Header:
        return {"op": "read_file", "root": root, "path": path,
                "limit": self.config.max_read_bytes}

    @staticmethod
    def write_file(root: str, path: str, uid: int | None) -> Header:
        """Write the frame's blob to ``root/path``, owned by ``uid`` where runs have their own."""
        return {"op": "write_file", "root": root, "path": path,
                "owner": [uid, uid] if uid is not None else None}

    def mkdir(self, path: str, uid: int | None, quota: bool) -> Header:
        """A session's directory: its own tmpfs of ``workspace_mb`` where ``quota``."""
        return {"op": "mkdir", "path": path, "uid": uid,
                "quota_mb": self.config.workspace_mb if quota else None}


def file_reply(reply: Header, verb: str, path: str) -> None:
    """Raise ``SandboxFileError`` unless the zygote answered ``ok`` to a file request."""
    if reply.get("op") != "ok":
        raise SandboxFileError(f"cannot {verb} {path!r}: {reply.get('error')}")

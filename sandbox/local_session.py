"""The local backend's record of a session (its directory, uid, worker, forks) and the small
helpers ``LocalSandbox`` uses on it."""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from typing import Any

from palaestra.sandbox.result import ExecResult


@dataclass
class _LocalSession:
    """One open session of a ``LocalSandbox``."""

    sid: str
    workdir: str
    uid: int | None
    worker: int
    persistent: bool
    had_kernel: bool = False
    note: str = ""  # told to the caller on the next result (e.g. files lost in a crash)
    nursery: str | None = None  # where its forks' workspaces go (persistent, fork-capable)
    family: _Family | None = None  # the sessions forked from one another, sharing a uid


@dataclass
class _Family:
    """Sessions forked from one another: one uid, one pid namespace, one root nursery."""

    root_nursery: str
    members: set[str] = dataclasses.field(default_factory=set)


LOST_FILES_NOTE = ("[palaestra: the sandbox worker restarted; this session's working directory "
                   "was re-created empty]\n")


def _with_note(result: ExecResult, handle: _LocalSession | None) -> ExecResult:
    if handle is None or not handle.note or result.error:
        return result
    note, handle.note = handle.note, ""
    return dataclasses.replace(result, stderr=note + result.stderr)


def _remove_tree(path: str) -> None:
    try:
        os.rmdir(path)  # the common case: a trivial run leaves an empty directory
        return
    except FileNotFoundError:
        return
    except OSError:
        pass

    def _retry(func: Any, p: str, _exc: Any) -> None:
        try:
            os.chmod(os.path.dirname(p), 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=_retry)

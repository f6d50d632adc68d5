"""Host memory of a long run: hand freed heap pages back to the system, and read the RSS.

PyTorch on CPU allocates and frees tensors of every size from several threads (the engine's
scheduler, rollout workers, the learner's thread), and glibc keeps each thread's arena heaps
(64 MiB each) once touched: freed memory stays in the process. A Search-R1 run on SmolLM2 grew
to 24 GiB over 13 RL steps this way and was killed by the kernel, with ~170 arena heaps of
~64 MiB resident. `release_freed_memory` (glibc's ``malloc_trim(0)``, which returns the free
pages of every arena) after each train step keeps such a run flat; elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from typing import Any


@functools.cache
def _libc() -> Any | None:
    """glibc, when this process runs on it (``malloc_trim`` is a glibc function)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def release_freed_memory() -> bool:
    """Return the free pages of the C heap's arenas to the system; True when something was
    released (glibc only; False elsewhere)."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def resident_gib() -> float | None:
    """This process's resident set size in GiB (Linux's ``/proc/self/statm``), else None."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30


__all__ = ["release_freed_memory", "resident_gib"]

"""`palaestra.host_memory`: freed heap pages of other threads' arenas go back to the system.

The premise is built, not assumed: a worker thread allocates ~200 MiB in 64 KiB blocks (below
glibc's mmap threshold, so they live in the thread's arena), frees all but every sixteenth
block (so the arena cannot shrink from its top), and the process's RSS is read before and after
`release_freed_memory`."""

from __future__ import annotations

import ctypes
import sys
import threading

import pytest

from palaestra.host_memory import _libc, release_freed_memory, resident_gib

BLOCK = 64 * 1024


def _fragment_an_arena(keep: list[ctypes.Array]) -> None:
    blocks = [ctypes.create_string_buffer(BLOCK) for _ in range(3200)]  # touched: resident
    keep.extend(blocks[::16])
    blocks.clear()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_the_freed_pages_of_a_thread_arena_leave_the_process() -> None:
    # release_freed_memory's False also means "nothing to release": ask for glibc itself
    if _libc() is None or resident_gib() is None:
        pytest.skip("not glibc on Linux")
    kept: list[ctypes.Array] = []
    worker = threading.Thread(target=_fragment_an_arena, args=(kept,))
    worker.start()
    worker.join()
    before = resident_gib()
    release_freed_memory()
    after = resident_gib()
    assert before is not None and after is not None
    freed_gib = 3000 * BLOCK / 2**30  # ~0.18 GiB freed, ~12 MiB still held
    assert before - after > 0.5 * freed_gib, (before, after)
    assert len(kept) == 200

"""Small helpers to call async code from sync code and back, safely inside or outside a loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_THREAD_POOL: concurrent.futures.ThreadPoolExecutor | None = None


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from synchronous code.

    Uses ``asyncio.run`` when no loop is running in this thread; otherwise (a sync API called from
    inside a running loop, e.g. a notebook) runs it on a private loop in a helper thread, because
    blocking the caller's loop on itself would deadlock.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    global _THREAD_POOL
    if _THREAD_POOL is None:
        _THREAD_POOL = concurrent.futures.ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="palaestra-run-sync"
        )
    return _THREAD_POOL.submit(asyncio.run, coro).result()

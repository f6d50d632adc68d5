"""Small helpers to call async code from sync code and back, safely inside or outside a loop,
and to wait for the signals that stop a server command."""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# Process-wide on purpose: its threads keep nothing between calls (each call is an
# ``asyncio.run`` on a fresh loop that is closed when the call returns), so a second run in the
# process reuses them and cannot see anything of the first.
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


async def in_daemon_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a daemon thread: unlike ``asyncio.to_thread``, a call that
    blocks (a rendezvous nobody joins, a broadcast to a dead peer) does not hold up exit."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

    def run() -> None:
        try:
            outcome = (True, fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            outcome = (False, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:
            pass  # the loop is gone (the caller gave up and exited): nobody to tell

    threading.Thread(target=run, name=f"palaestra-{getattr(fn, '__name__', 'call')}",
                     daemon=True).start()
    return await future


async def wait_for_stop_signal() -> None:
    """Return once SIGINT or SIGTERM arrives (a server command's main loop: serve until stopped)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

"""One background event loop per process for the ecosystem clients (MCP sessions, OpenEnv sockets).

Their SDKs' connections (anyio task groups, websockets) belong to the loop that opened them,
while an env is stepped from many loops (``asyncio.run`` per sync step, a rollout worker's loop,
threads). So every such connection lives on one daemon thread's loop; callers on any loop await
`on_background(coro)`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _BackgroundLoop:
    """One daemon thread running an event loop for every MCP connection of this process."""

    _lock = threading.Lock()
    _instance: _BackgroundLoop | None = None

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="palaestra-mcp-loop", daemon=True
        )
        self.thread.start()

    @classmethod
    def get(cls) -> _BackgroundLoop:
        with cls._lock:
            if cls._instance is None or not cls._instance.thread.is_alive():
                cls._instance = cls()
            return cls._instance

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)


async def on_background(coro: Coroutine[Any, Any, T]) -> T:
    """Await ``coro`` run on the shared MCP loop, from any event loop."""
    background = _BackgroundLoop.get()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is background.loop:
        return await coro
    return await asyncio.wrap_future(background.submit(coro))

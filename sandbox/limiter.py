"""Concurrency and rate limiting shared by every sandbox of a rollout worker.

One ``ExecLimiter`` can be passed to many sandboxes (``Sandbox(limiter=...)``) so that all the
episodes of a worker together never run more than ``max_concurrency`` programs at once nor
start more than ``rate_per_s`` per second.
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType

from palaestra.errors import ConfigError


class ExecLimiter:
    """``async with limiter:`` around one execution: a semaphore plus a token bucket."""

    def __init__(self, max_concurrency: int = 8, rate_per_s: float | None = None,
                 burst: int | None = None) -> None:
        if max_concurrency < 1:
            raise ConfigError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if rate_per_s is not None and rate_per_s <= 0:
            raise ConfigError(f"rate_per_s must be > 0 or None, got {rate_per_s}")
        self.max_concurrency = max_concurrency
        self.rate_per_s = rate_per_s
        self.burst = burst if burst is not None else max(1, int(rate_per_s or 1))
        self._sem = asyncio.Semaphore(max_concurrency)
        self._tokens = float(self.burst)
        self._stamp = time.monotonic()
        self._bucket_lock = asyncio.Lock()
        self.in_flight = 0

    async def _take_token(self) -> None:
        if self.rate_per_s is None:
            return
        async with self._bucket_lock:  # FIFO among waiters
            while True:
                now = time.monotonic()
                self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate_per_s)
                self._stamp = now
                if self._tokens >= 1.0:
                    self._tokens -= 1.0
                    return
                await asyncio.sleep((1.0 - self._tokens) / self.rate_per_s)

    async def __aenter__(self) -> ExecLimiter:
        await self._sem.acquire()
        try:
            await self._take_token()
        except BaseException:
            self._sem.release()
            raise
        self.in_flight += 1
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.in_flight -= 1
        self._sem.release()

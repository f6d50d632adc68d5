"""Rate limits and retries for remote models: a requests-per-minute limiter and backoff on 429/5xx.

`is_retryable` recognises throttling (HTTP 429), server errors (5xx), dropped connections and
timeouts from the ``openai`` client, ``aiohttp`` and palaestra's `EngineUnavailableError`;
`with_retries` retries those with exponential backoff and jitter, honouring ``Retry-After``.
Client errors (400, 401, 404, ...) are not retried: they will not get better.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def _chain(exc: BaseException) -> list[BaseException]:
    """The exception and the ones it was raised from (engines wrap client errors)."""
    out: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in out and len(out) < 8:
        out.append(current)
        current = current.__cause__
    return out


def status_of(exc: BaseException) -> int | None:
    """The HTTP status an exception (or its cause) carries: openai, aiohttp, palaestra errors."""
    for err in _chain(exc):
        for attr in ("status_code", "status", "http_status"):
            value = getattr(err, attr, None)
            if isinstance(value, int):
                return value
        response = getattr(err, "response", None)
        value = getattr(response, "status_code", None) or getattr(response, "status", None)
        if isinstance(value, int):
            return value
    return None


def is_retryable(exc: BaseException) -> bool:
    status = status_of(exc)
    if status is not None:
        return status == 429 or status >= 500 or status == 408
    names = {cls.__name__ for err in _chain(exc) for cls in type(err).__mro__}
    transient = {
        "EngineUnavailableError",
        "APIConnectionError",
        "APITimeoutError",
        "ClientConnectionError",
        "ServerDisconnectedError",
        "ClientPayloadError",
        "TimeoutError",
        "ConnectionError",
    }
    return bool(names & transient)


def retry_after_s(exc: BaseException) -> float | None:
    """The server's ``Retry-After`` (seconds) when the error carries one."""
    for err in _chain(exc):
        response = getattr(err, "response", None)
        headers = getattr(response, "headers", None) or getattr(err, "headers", None)
        if not headers:
            continue
        try:
            value = headers.get("retry-after") or headers.get("Retry-After")
            return float(value) if value is not None else None
        except (TypeError, ValueError, AttributeError):
            return None
    return None


async def with_retries(
    call: Callable[[], Awaitable[T]],
    *,
    retries: int = 6,
    base_delay_s: float = 1.0,
    max_delay_s: float = 60.0,
    retryable: Callable[[BaseException], bool] = is_retryable,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
) -> T:
    """``await call()``, retrying retryable errors up to ``retries`` times with backoff."""
    attempt = 0
    while True:
        try:
            return await call()
        except Exception as exc:
            if attempt >= retries or not retryable(exc):
                raise
            delay = min(max_delay_s, base_delay_s * 2**attempt) * random.uniform(0.5, 1.0)
            hinted = retry_after_s(exc)
            if hinted is not None:
                delay = min(max_delay_s, max(delay, hinted))
            attempt += 1
            if on_retry is not None:
                on_retry(attempt, exc, delay)
            await asyncio.sleep(delay)


class RateLimiter:
    """At most ``per_minute`` acquisitions in any sliding minute (None = unlimited)."""

    def __init__(self, per_minute: float | None) -> None:
        if per_minute is not None and per_minute <= 0:
            from palaestra.errors import ConfigError

            raise ConfigError(f"a rate limit must be positive, got {per_minute}")
        self.interval = 60.0 / per_minute if per_minute else 0.0
        self._next = 0.0
        self._lock: asyncio.Lock | None = None

    async def acquire(self) -> None:
        if not self.interval:
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # requests are spaced evenly: no burst then a stall
            now = time.monotonic()
            wait = self._next - now
            self._next = max(now, self._next) + self.interval
        if wait > 0:
            await asyncio.sleep(wait)


def describe_retry(name: str) -> Callable[[int, BaseException, float], None]:
    """An ``on_retry`` callback that logs one line per retry to stderr."""
    import sys

    def log(attempt: int, exc: BaseException, delay: float) -> None:
        status = status_of(exc)
        what = f"HTTP {status}" if status else type(exc).__name__
        print(f"[{name}] {what}; retry {attempt} in {delay:.1f} s", file=sys.stderr)

    return log


__all__ = ["RateLimiter", "describe_retry", "is_retryable", "retry_after_s", "status_of", "with_retries"]

"""Retry classification and backoff, and the requests-per-minute limiter."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from palaestra.benchmarks.limits import RateLimiter, is_retryable, retry_after_s, status_of, with_retries
from palaestra.errors import ConfigError, EngineError
from palaestra.engine import EngineUnavailableError


class HTTPStatusError(Exception):
    """Shaped like the openai client's errors: ``status_code`` and ``response.headers``.

    (The real client errors go through these paths in test_chat_path, against an HTTP server.)
    """

    def __init__(self, status, headers=None):
        super().__init__(f"status {status}")
        self.status_code = status
        self.response = SimpleNamespace(status_code=status, headers=headers or {})


class RateLimitError(HTTPStatusError):
    pass


class InternalServerError(HTTPStatusError):
    pass


class BadRequestError(HTTPStatusError):
    pass


class AuthenticationError(HTTPStatusError):
    pass


openai = SimpleNamespace(RateLimitError=RateLimitError, InternalServerError=InternalServerError,
                         BadRequestError=BadRequestError, AuthenticationError=AuthenticationError)


def _openai_error(cls, status, headers=None):
    return cls(status, headers)


def test_what_is_retried():
    assert is_retryable(_openai_error(openai.RateLimitError, 429))
    assert is_retryable(_openai_error(openai.InternalServerError, 503))
    assert not is_retryable(_openai_error(openai.BadRequestError, 400))
    assert not is_retryable(_openai_error(openai.AuthenticationError, 401))
    assert is_retryable(EngineUnavailableError("connection refused"))
    assert is_retryable(ConnectionResetError())
    assert not is_retryable(EngineError("bad request"))
    assert not is_retryable(ValueError("a bug"))
    # engines wrap client errors: the status of the cause counts
    try:
        try:
            raise _openai_error(openai.BadRequestError, 400)
        except openai.BadRequestError as exc:
            raise EngineError("wrapped") from exc
    except EngineError as wrapped:
        assert status_of(wrapped) == 400 and not is_retryable(wrapped)
    throttled = _openai_error(openai.RateLimitError, 429, {"Retry-After": "7"})
    assert retry_after_s(throttled) == 7.0


async def test_backoff_retries_then_succeeds_and_honours_retry_after():
    failures = [_openai_error(openai.RateLimitError, 429, {"Retry-After": "0.05"}),
                _openai_error(openai.InternalServerError, 502)]
    delays = []

    async def call():
        if failures:
            raise failures.pop(0)
        return "ok"

    result = await with_retries(call, retries=3, base_delay_s=0.001,
                                on_retry=lambda attempt, exc, delay: delays.append(delay))
    assert result == "ok" and len(delays) == 2
    assert delays[0] >= 0.05  # Retry-After beats a shorter backoff
    assert delays[1] <= 0.002  # base * 2 ** 1, jittered down


async def test_no_retry_on_client_errors_and_a_bounded_number_otherwise():
    calls = {"n": 0}

    async def bad_request():
        calls["n"] += 1
        raise _openai_error(openai.BadRequestError, 400)

    with pytest.raises(openai.BadRequestError):
        await with_retries(bad_request, retries=5, base_delay_s=0.001)
    assert calls["n"] == 1

    calls["n"] = 0

    async def always_503():
        calls["n"] += 1
        raise _openai_error(openai.InternalServerError, 503)

    with pytest.raises(openai.InternalServerError):
        await with_retries(always_503, retries=2, base_delay_s=0.001)
    assert calls["n"] == 3


async def test_rate_limiter_spaces_requests_evenly():
    limiter = RateLimiter(per_minute=60_000)  # one request per millisecond
    assert limiter.interval == pytest.approx(0.001)
    await limiter.acquire()
    first = limiter._next
    for _ in range(9):
        await limiter.acquire()
    # the schedule (not the wall clock) advanced one interval per request
    assert limiter._next - first >= 9 * limiter.interval - 1e-9
    unlimited = RateLimiter(None)
    for _ in range(100):
        await unlimited.acquire()
    with pytest.raises(ConfigError):
        RateLimiter(0)

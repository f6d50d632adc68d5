"""What the gateway learns from its engines: their context length, and whether a refusal of the
engine was a context overflow.

`engine_context` asks an engine how many tokens one sequence (prompt + completion) may hold:

- an in-process engine (`LocalEngine`) has ``max_model_len``;
- a `Router` answers the smallest context of its engines (a request may land on any);
- an HTTP engine (`SGLangClient`, SGLang or `palaestra serve`) is asked over HTTP, first
  ``GET /get_model_info`` (``context_length`` / ``max_model_len`` / ``max_context_length``, where
  a server reports it there), then ``GET /v1/models`` (``data[].max_model_len``: SGLang fills it
  from ``model_config.context_len``, `palaestra serve` from the engine), then
  ``GET /get_server_info`` (``context_length``, set when SGLang was started with
  ``--context-length``; `palaestra serve` always reports it).

`resolve_max_context` turns that and a requested limit into the gateway's tokens per sample: the
engine's context when none is requested, the request when it fits, and a `ConfigError` saying
what to do when the request is larger than the engine can take.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from typing import Any

from palaestra.errors import ConfigError, EngineError
from palaestra.engine import EngineUnavailableError, TokenGenerator

MODEL_INFO_FIELDS = ("context_length", "max_model_len", "max_context_length", "context_len")
SERVER_INFO_FIELDS = ("context_length", "max_model_len")
PROBE_TIMEOUT_S = 10.0

#: phrasings of engines that refuse a request for its length (SGLang, palaestra serve, vLLM)
_OVERFLOW = re.compile(
    r"longer than the model's context length|exceeds the model's maximum context length|"
    r"maximum context length is|the engine's context is|context_length_exceeded|"
    r"is longer than the maximum model length",
    re.IGNORECASE)


def is_context_overflow(error: BaseException) -> bool:
    """Whether an engine's refusal says the request does not fit its context."""
    return bool(_OVERFLOW.search(str(error)))


def _positive(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def _from_fields(payload: Any, fields: tuple[str, ...]) -> int | None:
    if not isinstance(payload, Mapping):
        return None
    for name in fields:
        found = _positive(payload.get(name))
        if found is not None:
            return found
    return None


async def _http_context(client: Any) -> int | None:
    """The context an SGLang-compatible server reports (see the module docstring)."""
    async def get(path: str) -> Any:
        try:
            return await client.request("GET", path, retries=1, timeout_s=PROBE_TIMEOUT_S)
        except EngineUnavailableError:  # down or failing: say so rather than guess
            raise
        except EngineError:  # a 4xx: the server lacks the route
            return None

    found = _from_fields(await get("/get_model_info"), MODEL_INFO_FIELDS)
    if found is not None:
        return found
    models = await get("/v1/models")
    cards = models.get("data") if isinstance(models, Mapping) else None
    lengths = [n for card in (cards if isinstance(cards, list) else ())
               if (n := _from_fields(card, ("max_model_len",))) is not None]
    if lengths:
        return min(lengths)
    return _from_fields(await get("/get_server_info"), SERVER_INFO_FIELDS)


async def engine_context(engine: TokenGenerator) -> int | None:
    """Tokens one sequence may hold on ``engine``, or None when it does not say."""
    members = getattr(engine, "engines", None)
    if isinstance(members, list) and members:  # a Router: the smallest context of its engines
        found = await asyncio.gather(*(engine_context(m) for m in members))
        known = [n for n in found if n is not None]
        return min(known) if known else None
    direct = _positive(getattr(engine, "max_model_len", None))
    if direct is not None:
        return direct
    if callable(getattr(engine, "request", None)) and hasattr(engine, "url"):
        return await _http_context(engine)
    return None


def resolve_max_context(requested: int | None, engine_limit: int | None, where: str) -> int:
    """The gateway's tokens per sample from ``--max-context`` and the engine's context."""
    if requested is not None and requested < 1:
        raise ConfigError(f"max_context must be a positive token count, got {requested}")
    if engine_limit is None:
        if requested is None:
            raise ConfigError(
                f"{where} does not report its context length (/get_model_info, /v1/models "
                "max_model_len, /get_server_info context_length); give --max-context")
        return requested
    if requested is None:
        return engine_limit
    if requested > engine_limit:
        raise ConfigError(
            f"--max-context {requested} exceeds the context of {where} ({engine_limit} "
            f"tokens): longer samples would fail in the engine; give --max-context "
            f"{engine_limit} or less, or leave it out to use the engine's")
    return requested


__all__ = ["engine_context", "is_context_overflow", "resolve_max_context"]

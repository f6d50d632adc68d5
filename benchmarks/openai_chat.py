"""`OpenAIChat`: the `ChatModel` of ``--engine openai`` (any OpenAI-compatible endpoint).

Transport is the engines' `OpenAIEngine` (its own retries off); on top of it the harness spaces
requests under ``--rpm``, retries HTTP 429/5xx and dropped connections with backoff, sends messages
in the strict wire form (no reasoning, no name on tool messages) and, before any work, checks that
the endpoint answers, the key is accepted and the model name is served.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from palaestra.benchmarks.chat_episode import ChatReply
from palaestra.benchmarks.limits import RateLimiter, describe_retry, with_retries
from palaestra.errors import ConfigError, EngineError
from palaestra.engine import SamplingParams
from palaestra.types import Message


def _wire(message: Message) -> dict[str, Any]:
    """A message as strict OpenAI servers accept it (no reasoning, no name on tool messages)."""
    out = message.to_dict()
    out.pop("reasoning_content", None)
    if message.role == "tool":
        out.pop("name", None)
    if message.role == "assistant" and message.tool_calls and not message.content:
        out["content"] = None
    return out


class OpenAIChat:
    """A `ChatModel` over an OpenAI-compatible endpoint: `OpenAIEngine` (the transport) with the
    harness's rate limit and retries on top, and a preflight check of endpoint, key and model."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str,
        *,
        timeout_s: float = 600.0,
        retries: int = 6,
        rpm: float | None = None,
        extra_body: Mapping[str, Any] | None = None,
        retry_base_s: float = 1.0,
    ) -> None:
        from palaestra.engines.clients.openai_engine import OpenAIEngine

        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        # retries happen here (logged, with Retry-After and our backoff), not inside the client
        self.engine = OpenAIEngine(
            model,
            base_url=self.base_url,
            api_key=api_key,
            timeout_s=timeout_s,
            max_retries=0,
            max_concurrency=1 << 20,  # the harness's --concurrency bounds the requests
        )
        self.retries = retries
        self.retry_base_s = retry_base_s
        self.requests = 0
        self.limiter = RateLimiter(rpm)
        self.extra_body = dict(extra_body or {})

    async def check(self) -> None:
        """Reach the endpoint and check the key and the model name before any work starts."""
        import asyncio

        names = await asyncio.to_thread(_list_models, self.base_url, self.api_key)
        if names and self.model not in names:
            raise ConfigError(
                f"{self.base_url} does not serve a model named {self.model!r}; it serves "
                f"{', '.join(names[:10])}"
            )

    async def chat(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]],
        sampling: SamplingParams,
    ) -> ChatReply:
        params: dict[str, Any] = {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_new_tokens,
        }
        if sampling.seed is not None:
            params["seed"] = sampling.seed
        if sampling.stop:
            params["stop"] = list(sampling.stop)
        extra = dict(self.extra_body)
        if sampling.top_k != -1:
            extra["top_k"] = sampling.top_k  # vLLM/SGLang extension
        if extra:
            params["extra_body"] = extra
        wire = [_wire(m) for m in messages]

        async def call() -> Any:
            await self.limiter.acquire()
            self.requests += 1
            return await self.engine.chat_full(wire, list(tools) or None, **params)

        result = await with_retries(
            call,
            retries=self.retries,
            base_delay_s=self.retry_base_s,
            on_retry=describe_retry(self.base_url),
        )
        return ChatReply(
            message=result.message,
            finish_reason=result.finish_reason or "stop",
            prompt_tokens=int(result.prompt_tokens or 0),
            completion_tokens=int(result.completion_tokens or 0),
        )

    async def close(self) -> None:
        await self.engine.close()


def _list_models(base_url: str, api_key: str, timeout_s: float = 15.0) -> list[str]:
    """Model ids of ``GET {base_url}/models``; a clear `EngineError` when that fails."""
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        f"{base_url}/models", headers={"Authorization": f"Bearer {api_key}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = json.loads(response.read().decode() or "{}")
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise EngineError(
                f"{base_url} rejected the API key (HTTP {exc.code}); set the right key in the "
                "variable named by --api-key-env (default OPENAI_API_KEY)"
            ) from None
        if exc.code == 404:
            return []  # some compatible servers have no /models; the first request will tell
        raise EngineError(f"{base_url}/models answered HTTP {exc.code}; is the server healthy?") from None
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        raise EngineError(
            f"cannot reach {base_url} ({reason}); start the server (e.g. `palaestra serve --model "
            "PATH --port 8000`) or fix --base-url"
        ) from None
    data = body.get("data") if isinstance(body, dict) else None
    return [str(m.get("id")) for m in data or [] if isinstance(m, dict)]


__all__ = ["OpenAIChat"]

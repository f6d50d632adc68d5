"""`OpenAIEngine`: API models through any OpenAI-compatible endpoint, at the message level.

For **evaluation only**: the endpoint tokenizes, renders the chat template and parses tool calls
on its side, so what comes back is text and structured tool calls, not the exact token ids and
sampling logprobs a training sample needs. It is therefore not an `Engine` (no ``generate`` over
token ids); the rollout uses it through ``chat``:

    engine = OpenAIEngine(model="gpt-4o-mini")              # OPENAI_API_KEY from the environment
    engine = OpenAIEngine(model="tiny", base_url="http://127.0.0.1:30000/v1", api_key="none")
    reply = await engine.chat(messages, tools=tools, temperature=0)   # -> palaestra Message
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from palaestra.errors import EngineError, MissingExtraError
from palaestra.engine import EngineUnavailableError
from palaestra.types import Message, ToolCall


@dataclass(frozen=True)
class ChatResult:
    """One chat completion: the assistant message plus what the API reported about it."""

    message: Message
    finish_reason: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    model: str = ""


class OpenAIEngine:
    """Message-level client of an OpenAI-compatible chat completions endpoint (not token-exact)."""

    token_exact = False

    def __init__(self, model: str, *, base_url: str | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0, max_retries: int = 3, max_concurrency: int = 64,
                 default_params: Mapping[str, Any] | None = None) -> None:
        try:
            import openai
        except ImportError as exc:  # pragma: no cover - openai is a core dependency
            raise MissingExtraError.for_module("openai", "openai") from exc
        self.model = model
        self.default_params = dict(default_params or {})
        self._client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s,
                                          max_retries=max_retries)
        self._limit = asyncio.Semaphore(max_concurrency)

    async def chat(self, messages: Sequence[Message | Mapping[str, Any]],
                   tools: Sequence[Mapping[str, Any]] | None = None, **sampling: Any) -> Message:
        """The assistant's reply as a `Message` (``tool_calls`` parsed by the endpoint)."""
        return (await self.chat_full(messages, tools, **sampling)).message

    async def chat_full(self, messages: Sequence[Message | Mapping[str, Any]],
                        tools: Sequence[Mapping[str, Any]] | None = None,
                        **sampling: Any) -> ChatResult:
        import openai

        wire = [m.to_dict() if isinstance(m, Message) else dict(m) for m in messages]
        params = {**self.default_params, **sampling}
        if tools:
            params["tools"] = list(tools)
        try:
            async with self._limit:
                resp = await self._client.chat.completions.create(
                    model=self.model, messages=wire, **params)  # type: ignore[arg-type]
        except (openai.APIConnectionError, openai.APITimeoutError, openai.InternalServerError,
                openai.RateLimitError) as exc:
            raise EngineUnavailableError(f"{self.model}: {type(exc).__name__}: {exc}") from exc
        except openai.APIError as exc:
            raise EngineError(f"{self.model}: {type(exc).__name__}: {exc}") from exc
        if not resp.choices:
            raise EngineError(f"{self.model} returned no choices")
        choice = resp.choices[0]
        msg = choice.message
        functions = [(c, getattr(c, "function", None)) for c in (msg.tool_calls or ())]
        calls = tuple(
            ToolCall(name=f.name, arguments=f.arguments or "{}", id=c.id or "")
            for c, f in functions if f is not None  # custom (non-function) tool calls are skipped
        )
        reasoning = getattr(msg, "reasoning_content", None)
        usage = resp.usage
        return ChatResult(
            message=Message(role="assistant", content=msg.content or "", tool_calls=calls,
                            reasoning_content=reasoning if isinstance(reasoning, str) else None),
            finish_reason=str(choice.finish_reason or ""),
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
            model=resp.model or self.model,
        )

    async def health(self) -> bool:
        try:
            await self._client.models.list()
        except Exception:
            return False
        return True

    async def close(self) -> None:
        await self._client.close()


__all__ = ["ChatResult", "OpenAIEngine"]

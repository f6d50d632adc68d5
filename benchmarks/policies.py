"""Policies the harness evaluates: a token-level engine with agents, or a chat API model.

- `TokenPolicy`: any `Engine` (embedded `LocalEngine`, `SGLangEngine`/`Router` over HTTP, a
  scripted engine in tests) plus the agent of each benchmark's family, as a `TokenPlayer`;
- `ChatPolicy`: a `ChatModel` (`palaestra.benchmarks.openai_chat.OpenAIChat` for an
  OpenAI-compatible endpoint), as a message-level `ChatPlayer`.

Both play through `palaestra.rollout.play.play_episode`, the loop training uses, so parsers,
rewards, limits and stop reasons are the same.

Remote token-level engines go through `RetryingEngine`, which spaces requests under a rate limit
and retries HTTP 429/5xx and dropped connections with backoff (`OpenAIChat` does the same).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from palaestra.benchmarks.chat_episode import ChatModel, ChatPlayer
from palaestra.benchmarks.limits import RateLimiter, describe_retry, with_retries
from palaestra.benchmarks.spec import Benchmark
from palaestra.engine import Engine, Generation, SamplingParams
from palaestra.errors import EngineError
from palaestra.rollout.play import play_episode
from palaestra.types import Trajectory

if TYPE_CHECKING:
    from palaestra.benchmarks.runner import SampleRequest
    from palaestra.contracts import RolloutEnv, Tokenizer


class RetryingEngine:
    """An `Engine` whose `generate` is rate limited and retried on transient failures."""

    def __init__(
        self,
        engine: Engine,
        *,
        retries: int = 6,
        rpm: float | None = None,
        name: str = "engine",
        retry_base_s: float = 1.0,
    ) -> None:
        self.engine = engine
        self.retries = retries
        self.retry_base_s = retry_base_s
        self.limiter = RateLimiter(rpm)
        self.name = name

    def __getattr__(self, item: str) -> Any:  # everything but generate goes to the engine
        return getattr(self.engine, item)

    @property
    def weight_version(self) -> int:
        return int(self.engine.weight_version)

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> Generation:
        async def call() -> Generation:
            await self.limiter.acquire()
            return await self.engine.generate(
                input_ids, sampling, request_id=request_id, session_id=session_id
            )

        return await with_retries(
            call,
            retries=self.retries,
            base_delay_s=self.retry_base_s,
            on_retry=describe_retry(self.name),
        )


class TokenPolicy:
    """Episodes through `run_episode` with an engine and one agent per episode."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        *,
        model: str,
        family: str = "qwen",
        max_context: int = 4096,
        enable_thinking: bool | None = None,
        owns_engine: bool = False,
    ) -> None:
        from palaestra.agents import get_renderer

        get_renderer(family)  # an unknown family fails now
        self.engine = engine
        self.tokenizer = tokenizer
        self.model = model
        self.family = family
        self.max_context = max_context
        self.enable_thinking = enable_thinking
        self.owns_engine = owns_engine

    async def check(self) -> None:
        try:
            start = getattr(self.engine, "start", None)  # engines that attach lazily (SGLang)
            if start is not None:
                await start()
            healthy = await self.engine.health()
        except Exception as exc:
            raise EngineError(f"the engine for {self.model!r} is not usable: {exc}") from None
        if not healthy:
            raise EngineError(
                f"the engine for {self.model!r} reports it is not healthy; check its logs"
            )

    def agent_for(self, benchmark: Benchmark) -> Any:
        from palaestra.agents import make_agent

        options = dict(benchmark.agent)
        family = options.pop("family", self.family)
        options.setdefault("max_context", self.max_context)
        options.setdefault("enable_thinking", self.enable_thinking)
        return make_agent(self.tokenizer, family, **options)

    async def play(self, env: RolloutEnv, benchmark: Benchmark, request: SampleRequest
                   ) -> Trajectory:
        from palaestra.rollout.episode import TokenPlayer

        player = TokenPlayer(self.agent_for(benchmark), self.engine)
        return await play_episode(request.to_episode(env, player, env_id=benchmark.env_id))

    async def close(self) -> None:
        if self.owns_engine:
            await self.engine.close()


class ChatPolicy:
    """Episodes through the message-level loop with a chat model."""

    def __init__(self, chat: ChatModel, *, model: str) -> None:
        self.chat = chat
        self.model = model

    async def check(self) -> None:
        check = getattr(self.chat, "check", None)
        if check is not None:
            await check()

    async def play(self, env: RolloutEnv, benchmark: Benchmark, request: SampleRequest
                   ) -> Trajectory:
        sampling = request.sampling
        if benchmark.chat_stop:
            sampling = replace(sampling, stop=tuple(benchmark.chat_stop))
        episode = request.to_episode(env, ChatPlayer(self.chat), env_id=benchmark.env_id)
        return await play_episode(replace(episode, sampling=sampling))

    async def close(self) -> None:
        close = getattr(self.chat, "close", None)
        if close is not None:
            await close()


__all__ = ["ChatPolicy", "RetryingEngine", "TokenPolicy"]

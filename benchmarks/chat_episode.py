"""The message-level episode loop, for chat APIs that return messages instead of token ids.

It is `palaestra.rollout.run_episode` without the agent: the env's messages go to a `ChatModel`
(an OpenAI-compatible endpoint), its reply (text and structured tool calls, parsed by the API)
is the action, the env steps on it. Same contract: failures end the episode with a stop reason
and the error text on the `Trajectory`, which has no token samples (API models give no token
ids); token counts come from the API's usage report. Errors of the endpoint itself (unreachable,
HTTP 429/5xx after the retries, authentication) are marked with the stage ``chat:`` so the harness
retries those samples later instead of recording them as the model's failures.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from time import perf_counter
from typing import Any, Protocol

from palaestra.benchmarks.limits import status_of
from palaestra.rollout.engines.base import SamplingParams
from palaestra.types import Message, StopReason, Trajectory, Turn

#: HTTP statuses that mean "this request cannot be served" (recorded as the sample's failure).
REQUEST_ERRORS = (400, 413, 422)


@dataclass(frozen=True)
class ChatReply:
    """One assistant reply of a chat API."""

    message: Message
    finish_reason: str  # "stop", "length", "tool_calls", "content_filter"
    prompt_tokens: int = 0
    completion_tokens: int = 0


class ChatModel(Protocol):
    """A message-level model: chat messages (and tool schemas) in, one assistant message out."""

    async def chat(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]],
        sampling: SamplingParams,
    ) -> ChatReply: ...


def close_cut_tags(message: Message, stops: Sequence[str]) -> Message:
    """Restore a closing tag the API cut off as a stop string (``<search>q`` -> ``<search>q</search>``).

    OpenAI-compatible APIs strip the matched stop string from the text; for tag protocols
    (Search-R1 stops at ``</search>`` so the model cannot invent the results) the env needs it.
    """
    content = message.content
    for stop in stops:
        if stop.startswith("</") and stop.endswith(">"):
            opener = "<" + stop[2:]
            if content.count(opener) > content.count(stop):
                return replace(message, content=content + stop)
    return message


def _stage_of(exc: BaseException) -> str:
    status = status_of(exc)
    if status in REQUEST_ERRORS:
        return "chat-request"  # the request itself was refused: the sample failed
    return "chat"  # the endpoint failed (or refused us): retry the sample in a later run


def _too_long(exc: BaseException) -> bool:
    text = str(exc).lower()
    return status_of(exc) in REQUEST_ERRORS and ("context" in text or "too long" in text or "maximum" in text)


async def run_chat_episode(
    env: Any,
    model: ChatModel,
    sampling: SamplingParams,
    *,
    seed: int | None = None,
    task: Mapping[str, Any] | None = None,
    max_turns: int | None = None,
    step_timeout_s: float | None = None,
    env_id: str = "",
) -> Trajectory:
    """Play one episode with a chat model; never raises on failure."""
    began = perf_counter()
    messages: list[Message] = []
    turns: list[Turn] = []
    task_id = ""
    stop: StopReason | None = None
    error: str | None = None
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "requests": 0}
    timing = {"engine_s": 0.0, "env_s": 0.0}
    stage = "env.reset"
    try:
        options = {"task": dict(task)} if task is not None else None
        t = perf_counter()
        obs, info = await _bounded(env.areset(seed=seed, options=options), step_timeout_s)
        timing["env_s"] += perf_counter() - t
        task_id = str(info.get("task_id", ""))
        tools = list(info.get("tools") or ())
        messages.extend(obs)
        while stop is None:
            if max_turns is not None and len(turns) >= max_turns:
                stop = StopReason.TRUNCATED
                break
            stage = "chat"
            params = sampling
            if sampling.seed is not None:
                params = replace(sampling, seed=sampling.seed + usage["requests"])
            usage["requests"] += 1
            t = perf_counter()
            try:
                reply = await model.chat(messages, tools, params)
            except Exception as exc:
                if _too_long(exc):
                    stop = StopReason.TRUNCATED
                    break
                stage = _stage_of(exc)
                raise
            timing["engine_s"] += perf_counter() - t
            usage["prompt_tokens"] += reply.prompt_tokens
            usage["completion_tokens"] += reply.completion_tokens
            action = close_cut_tags(reply.message, sampling.stop)
            messages.append(action)
            if reply.finish_reason == "length":
                stop = StopReason.MAX_TOKENS
                break
            stage = "env.step"
            t = perf_counter()
            obs, reward, terminated, truncated, info = await _bounded(
                env.astep(action), step_timeout_s
            )
            timing["env_s"] += perf_counter() - t
            turns.append(Turn(action, tuple(obs), float(reward), info))
            messages.extend(obs)
            if terminated or truncated:
                default = StopReason.TERMINATED if terminated else StopReason.TRUNCATED
                stop = StopReason(info.get("stop_reason") or default)
    except (TimeoutError, asyncio.TimeoutError):
        stop, error = StopReason.TIMEOUT, f"{stage}: timed out after {step_timeout_s} s"
    except Exception as exc:  # a bad rollout is data, not a crash
        stop, error = StopReason.ERROR, f"{stage}: {type(exc).__name__}: {exc}"
    reward = float(sum(t.reward for t in turns))
    metrics = {
        "turns": float(len(turns)),
        "tool_calls": float(sum(int(t.info.get("tool_calls", 0)) for t in turns)),
        "tool_errors": float(sum(int(t.info.get("tool_errors", 0)) for t in turns)),
        "prompt_tokens": float(usage["prompt_tokens"]),
        "completion_tokens": float(usage["completion_tokens"]),
        "response_tokens": float(usage["completion_tokens"]),
        "requests": float(usage["requests"]),
        "wall_s": perf_counter() - began,
        **timing,
    }
    assert stop is not None
    return Trajectory(
        env_id=env_id or type(env).__name__,
        task_id=task_id,
        messages=tuple(messages),
        turns=tuple(turns),
        samples=(),
        reward=reward,
        stop_reason=stop,
        error=error,
        metrics=metrics,
    )


async def _bounded(awaitable: Any, timeout_s: float | None) -> Any:
    if timeout_s is None:
        return await awaitable
    return await asyncio.wait_for(awaitable, timeout_s)


__all__ = ["ChatModel", "ChatReply", "close_cut_tags", "run_chat_episode"]

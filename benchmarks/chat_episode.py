"""The message-level player, for chat APIs that return messages instead of token ids.

`ChatPlayer` plays the turns of the rollout's one stepped loop
(`palaestra.rollout.episode.play_stepped`) with a `ChatModel` (an OpenAI-compatible endpoint)
in place of an agent and engine: the env's messages go to the model, its reply (text and
structured tool calls, parsed by the API) is the action, the env steps on it. Same contract:
failures end the episode with a stop reason and the error text on the `Trajectory`, which has no
token samples (API models give no token ids); token counts come from the API's usage report. Errors of the endpoint itself (unreachable,
HTTP 429/5xx after the retries, authentication) are marked with the stage ``chat:`` so the harness
retries those samples later instead of recording them as the model's failures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from time import perf_counter
from typing import Any, Protocol

from palaestra.benchmarks.limits import status_of
from palaestra.engine import SamplingParams
from palaestra.episode_info import ResetInfo
from palaestra.rollout.episode import EpisodeRequest, EpisodeState, Move, Outcome
from palaestra.types import Message, StopReason

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


class ChatPlayer:
    """The turns of a stepped episode written by a `ChatModel` (message level, no token ids).

    Plays through `palaestra.rollout.episode.play_stepped`, the loop training uses (resets,
    steps, limits, rewards and stop reasons are the same code); the trajectory has no samples.
    """

    def __init__(self, model: ChatModel) -> None:
        self.model = model
        self.first: tuple[Message, ...] = ()  # the env's first observation
        self.messages: list[Message] = []  # the conversation sent to the model
        self.cut: Message | None = None  # a reply cut off by the length limit (never stepped)
        self.tools: list[Mapping[str, Any]] = []
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0}

    def start(self, observation: Sequence[Message], reset: ResetInfo, st: EpisodeState) -> None:
        self.first = tuple(observation)
        self.messages = list(observation)
        self.cut = None
        self.tools = list(reset.tools)
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0}

    async def act(self, request: EpisodeRequest, st: EpisodeState) -> Move:
        sampling = request.sampling
        st.stage = "chat"
        params = sampling
        if sampling.seed is not None:
            params = replace(sampling, seed=sampling.seed + st.requests)
        st.requests += 1
        t = perf_counter()
        try:
            reply = await self.model.chat(self.messages, self.tools, params)
        except Exception as exc:
            if _too_long(exc):
                return Move(stop=StopReason.TRUNCATED)
            st.stage = _stage_of(exc)
            raise
        st.engine_s += perf_counter() - t
        self.usage["prompt_tokens"] += reply.prompt_tokens
        self.usage["completion_tokens"] += reply.completion_tokens
        action = close_cut_tags(reply.message, sampling.stop)
        self.messages.append(action)
        if reply.finish_reason == "length":
            self.cut = action
            return Move(action, StopReason.MAX_TOKENS)
        return Move(action)

    def observe(self, observation: Sequence[Message], st: EpisodeState) -> bool:
        self.messages.extend(observation)
        return True

    def outcome(self, request: EpisodeRequest, st: EpisodeState, stop: StopReason) -> Outcome:
        # the conversation as played: every step's action and observation (the last one too,
        # which the loop does not hand to `observe`), and a reply cut off by the length limit
        messages = list(self.first)
        for turn in st.turns:
            messages += [turn.action, *turn.observation]
        if self.cut is not None:
            messages.append(self.cut)
        completion = float(self.usage["completion_tokens"])
        metrics = {"prompt_tokens": float(self.usage["prompt_tokens"]),
                   "completion_tokens": completion, "response_tokens": completion}
        return Outcome(messages=tuple(messages), metrics=metrics)


__all__ = ["ChatModel", "ChatPlayer", "ChatReply", "close_cut_tags"]

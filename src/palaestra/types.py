"""Core data types shared by every component: chat messages, tool calls, samples, trajectories.

All types are frozen dataclasses (hashable where their fields are, picklable, cheap). Token-level
sequences are tuples so a `Sample` can never be mutated after the engine produced it.

Shape suffixes follow the tinker-cookbook convention: ``_T`` per token.
"""

from __future__ import annotations

import enum
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from palaestra.errors import TrajectoryValidationError

Role = str  # "system" | "user" | "assistant" | "tool"
_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


class StopReason(str, enum.Enum):
    """Why an episode (or one generation) ended."""

    TERMINATED = "terminated"  # the env said the episode is over (answer given, goal reached)
    TRUNCATED = "truncated"  # max turns or context window reached
    MAX_TOKENS = "max_tokens"  # the engine hit the per-turn token budget
    PARSE_ERROR = "parse_error"  # too many consecutive malformed actions
    TIMEOUT = "timeout"  # a wall-clock limit of the episode or a tool elapsed
    ERROR = "error"  # the env, engine or sandbox raised; see `error`
    ABORTED = "aborted"  # interrupted (weight update, shutdown); may be resumed


@dataclass(frozen=True)
class ToolCall:
    """One function call requested by the model (OpenAI ``tool_calls[i]``).

    ``arguments`` is the raw JSON text as the model wrote it; the env decodes and validates it, so
    malformed JSON becomes an error observation rather than a parser crash. ``parse_error`` is set
    by a parser that found a call it could not decode at all (e.g. an unclosed tag).
    """

    name: str
    arguments: str = "{}"
    id: str = ""
    parse_error: str | None = None

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    @classmethod
    def from_openai(cls, data: Mapping[str, Any]) -> ToolCall:
        fn = data.get("function", data)
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args)
        return cls(name=str(fn.get("name", "")), arguments=args, id=str(data.get("id", "")))


@dataclass(frozen=True)
class Message:
    """One chat message in the OpenAI schema (role, content, tool_calls, tool_call_id, name)."""

    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None

    def __post_init__(self) -> None:
        if self.role not in _ROLES:
            raise ValueError(
                f"unknown message role {self.role!r}; use one of {sorted(_ROLES)}"
            )
        if not isinstance(self.content, str):
            raise TypeError(
                f"message content must be a str, got {type(self.content).__name__}; "
                "join multi-part content into one string first"
            )
        if not isinstance(self.tool_calls, tuple):
            object.__setattr__(self, "tool_calls", tuple(self.tool_calls))

    def to_dict(self) -> dict[str, Any]:
        """OpenAI wire format (what chat templates and ``/v1/chat/completions`` take)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Message:
        content = data.get("content") or ""
        if isinstance(content, list):  # OpenAI multi-part text content
            content = "".join(
                part.get("text", "") for part in content if isinstance(part, Mapping)
            )
        return cls(
            role=str(data["role"]),
            content=content,
            tool_calls=tuple(ToolCall.from_openai(c) for c in data.get("tool_calls") or ()),
            tool_call_id=data.get("tool_call_id"),
            name=data.get("name"),
            reasoning_content=data.get("reasoning_content"),
        )


def as_message(action: Message | str | Mapping[str, Any], role: Role = "assistant") -> Message:
    """Accept the forms users pass as an action: a Message, a plain string, or an OpenAI dict."""
    if isinstance(action, Message):
        return action
    if isinstance(action, str):
        return Message(role=role, content=action)
    if isinstance(action, Mapping):
        return Message.from_dict(action)
    raise TypeError(
        f"expected a Message, str or OpenAI message dict, got {type(action).__name__}"
    )


def messages_to_dicts(messages: Sequence[Message]) -> list[dict[str, Any]]:
    return [m.to_dict() for m in messages]


def _freeze_mapping(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(value or {}))


@dataclass(frozen=True)
class Turn:
    """One env step: the assistant action, the observation it produced and its reward."""

    action: Message
    observation: tuple[Message, ...]
    reward: float
    info: Mapping[str, Any] = field(default_factory=dict)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Turn, (self.action, self.observation, self.reward, dict(self.info)))


@dataclass(frozen=True)
class Sample:
    """Token-exact training data of one episode (or one agent-visible branch of it).

    ``token_ids_T`` holds prompt and completion tokens; ``loss_mask_T[i] == 1`` exactly for tokens
    sampled by the policy; ``logprobs_T`` holds the sampling logprob of those tokens (0.0
    elsewhere) and ``versions_T`` the policy version that sampled them (-1 elsewhere).
    """

    token_ids_T: tuple[int, ...]
    loss_mask_T: tuple[int, ...]
    logprobs_T: tuple[float, ...]
    versions_T: tuple[int, ...]
    prompt_len: int
    reward: float = 0.0
    turn_rewards: tuple[float, ...] = ()
    stop_reason: StopReason = StopReason.TERMINATED
    env_id: str = ""
    task_id: str = ""
    group_id: str = ""
    advantage: float | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    # token index (exclusive end) of each assistant turn, to map per-turn rewards to tokens
    turn_ends: tuple[int, ...] = ()
    # MoE routing replay: int tensor [tokens, layers, top_k] of the experts the engine chose at
    # each token (-1: not recorded, dense layers), or None (dense policy, engine without it)
    routed_experts: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.token_ids_T)
        routes = self.routed_experts
        if routes is not None and (len(getattr(routes, "shape", ())) != 3 or routes.shape[0] != n):
            raise TrajectoryValidationError(
                f"routed_experts must be a [tokens, layers, top_k] array with {n} tokens, got "
                f"shape {tuple(getattr(routes, 'shape', ()))}"
            )
        lengths = {
            "loss_mask_T": len(self.loss_mask_T),
            "logprobs_T": len(self.logprobs_T),
            "versions_T": len(self.versions_T),
        }
        bad = {k: v for k, v in lengths.items() if v != n}
        if bad:
            raise TrajectoryValidationError(
                f"Sample fields must have one entry per token ({n} tokens), got {bad}"
            )
        if not 0 <= self.prompt_len <= n:
            raise TrajectoryValidationError(
                f"prompt_len={self.prompt_len} is outside [0, {n}]"
            )

    def __reduce__(self) -> tuple[Any, ...]:
        state = {f: getattr(self, f) for f in self.__dataclass_fields__}
        state["metrics"] = dict(self.metrics)
        return (_rebuild_sample, (state,))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids_T)

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask_T)

    @property
    def min_version(self) -> int:
        """Oldest policy version among sampled tokens (-1 when nothing was sampled)."""
        return min(itertools.compress(self.versions_T, self.loss_mask_T), default=-1)

    def with_advantage(self, advantage: float) -> Sample:
        return replace(self, advantage=float(advantage))

    def validate(self, vocab_size: int | None = None) -> None:
        """Strict checks for samples that come from outside (gateway, POST /trajectories)."""
        if any(m not in (0, 1) for m in self.loss_mask_T):
            raise TrajectoryValidationError("loss_mask_T must contain only 0 and 1")
        if vocab_size is not None:
            bad = [t for t in self.token_ids_T if not 0 <= t < vocab_size]
            if bad:
                raise TrajectoryValidationError(
                    f"{len(bad)} token ids are outside the vocabulary [0, {vocab_size}), "
                    f"e.g. {bad[:3]}; tokenize with the policy's tokenizer"
                )
        if not all(math.isfinite(x) for x in self.logprobs_T):
            raise TrajectoryValidationError("logprobs_T contains NaN or infinite values")
        if any(x > 1e-6 for x, m in zip(self.logprobs_T, self.loss_mask_T) if m):
            raise TrajectoryValidationError("logprobs of sampled tokens must be <= 0")
        if not math.isfinite(self.reward):
            raise TrajectoryValidationError(f"reward must be finite, got {self.reward}")


def _rebuild_sample(state: dict[str, Any]) -> Sample:
    return Sample(**state)


@dataclass(frozen=True)
class Trajectory:
    """A finished (or failed) episode: messages, turns, token samples, rewards and outcome."""

    env_id: str
    task_id: str
    messages: tuple[Message, ...]
    turns: tuple[Turn, ...]
    samples: tuple[Sample, ...]
    reward: float
    stop_reason: StopReason
    error: str | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    group_id: str = ""

    def __reduce__(self) -> tuple[Any, ...]:
        state = {f: getattr(self, f) for f in self.__dataclass_fields__}
        state["metrics"] = dict(self.metrics)
        return (_rebuild_trajectory, (state,))

    @property
    def failed(self) -> bool:
        return self.stop_reason in (StopReason.ERROR, StopReason.TIMEOUT) or self.error is not None

    @property
    def turn_rewards(self) -> tuple[float, ...]:
        return tuple(t.reward for t in self.turns)

    def to_json(self) -> dict[str, Any]:
        """JSON-serialisable form (evaluation's samples.jsonl)."""
        return {
            "env_id": self.env_id,
            "task_id": self.task_id,
            "group_id": self.group_id,
            "reward": self.reward,
            "turn_rewards": list(self.turn_rewards),
            "stop_reason": self.stop_reason.value,
            "error": self.error,
            "metrics": dict(self.metrics),
            "messages": messages_to_dicts(self.messages),
            "samples": [
                {
                    "token_ids": list(s.token_ids_T),
                    "loss_mask": list(s.loss_mask_T),
                    "logprobs": list(s.logprobs_T),
                    "versions": list(s.versions_T),
                    "prompt_len": s.prompt_len,
                }
                for s in self.samples
            ],
        }


def _rebuild_trajectory(state: dict[str, Any]) -> Trajectory:
    return Trajectory(**state)


__all__ = [
    "Message",
    "Role",
    "Sample",
    "StopReason",
    "ToolCall",
    "Trajectory",
    "Turn",
    "as_message",
    "messages_to_dicts",
]

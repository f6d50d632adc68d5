"""Typed reset and step info, and the kind of episode an env plays.

`EpisodeKind` is what an env class declares (``episode_kind``) to say how its episodes are played:
stepped message by message by the rollout's loop (every gymnasium env), by an external agent
program through the agent gateway, or replayed from posted trajectories. The rollout maps each
kind to its runner (`palaestra.rollout.play.RUNNERS`); envs name no rollout module.

Reset and step info: what an env tells the rollout besides observations and rewards.

Gymnasium requires ``info`` to be a plain ``dict``, and palaestra keeps it one: it is recorded on
every `Turn`, written to JSONL, sent across Ray and read by people and gymnasium wrappers (which
copy dicts: ``dict(info)`` of a dict subclass would lose its type). So the dict stays the wire
format with flat keys, and these frozen dataclasses are the contract on both sides of it: envs
build a `ResetInfo`/`StepInfo` and return ``.to_info()``; the rollout reads
``StepInfo.from_info(info)`` and only its typed fields. The keys the framework reads are named
here once; every other key of an env (``correct``, ``extracted_answer``, ``searches``, ...) rides
along in ``extra``. A reserved key with a value of the wrong type is refused with a clear error
(`EnvInfoError`) instead of being summed into a metric.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from palaestra.errors import PalaestraError
from palaestra.types import StopReason

#: the keys of a reset info that the framework reads
RESET_KEYS = ("task_id", "tools")
#: the keys of a step info that the framework reads
STEP_KEYS = ("stop_reason", "tool_calls", "tool_errors", "sandbox_s", "final_reward")


class EpisodeKind(str, Enum):
    """How an env's episodes are played (the env class's ``episode_kind``)."""

    STEPPED = "stepped"  # reset/step message by message by the rollout's loop (the default)
    EXTERNAL_AGENT = "external_agent"  # an agent program calls the model through the gateway
    POSTED = "posted"  # trajectories posted to the gateway's buffer, claimed one per episode


class EnvInfoError(PalaestraError, TypeError):
    """An env's ``info`` has a reserved key with a value of the wrong type."""


@dataclass(frozen=True)
class ResetInfo:
    """What ``reset`` reports: the task's id and the tool schemas offered to the model."""

    task_id: str = ""
    tools: tuple[Mapping[str, Any], ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_info(self) -> dict[str, Any]:
        """The gymnasium ``info`` dict (env-specific keys first, the typed ones over them)."""
        return {**self.extra, "task_id": self.task_id, "tools": [dict(t) for t in self.tools]}

    @classmethod
    def from_info(cls, info: Mapping[str, Any] | None) -> ResetInfo:
        """Read a reset ``info`` dict (missing keys: defaults); raises `EnvInfoError`."""
        info = _mapping(info, "reset")
        tools = info.get("tools") or ()
        if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence) or not all(
            isinstance(t, Mapping) for t in tools
        ):
            raise EnvInfoError(
                f"reset info['tools'] must be a list of OpenAI tool schemas (dicts), got "
                f"{type(tools).__name__}; return env.tool_schemas()"
            )
        task_id = info.get("task_id")
        extra = {k: v for k, v in info.items() if k not in RESET_KEYS}
        return cls("" if task_id is None else str(task_id), tuple(dict(t) for t in tools), extra)


@dataclass(frozen=True)
class StepInfo:
    """What ``step`` reports besides observation and reward; None: the env did not say."""

    stop_reason: StopReason | None = None
    tool_calls: int | None = None  # tool calls run on this step
    tool_errors: int | None = None  # of those, the ones that became error messages
    sandbox_s: float | None = None  # seconds spent in the code sandbox on this step
    final_reward: float | None = None  # the episode-end part of this step's reward
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_info(self) -> dict[str, Any]:
        """The gymnasium ``info`` dict: env-specific keys, then the typed fields that are set."""
        out = dict(self.extra)
        if self.stop_reason is not None:
            out["stop_reason"] = StopReason(self.stop_reason).value
        for key in ("tool_calls", "tool_errors", "sandbox_s", "final_reward"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out

    @classmethod
    def from_info(cls, info: Mapping[str, Any] | None) -> StepInfo:
        """Read a step ``info`` dict; raises `EnvInfoError` for a reserved key of a wrong type."""
        info = _mapping(info, "step")
        raw_stop = info.get("stop_reason")
        try:
            stop = None if raw_stop in (None, "") else StopReason(raw_stop)
        except ValueError:
            known = ", ".join(s.value for s in StopReason)
            raise EnvInfoError(
                f"step info['stop_reason'] = {raw_stop!r} is not a stop reason ({known})"
            ) from None
        return cls(
            stop_reason=stop,
            tool_calls=_count(info, "tool_calls"),
            tool_errors=_count(info, "tool_errors"),
            sandbox_s=_number(info, "sandbox_s"),
            final_reward=_number(info, "final_reward"),
            extra={k: v for k, v in info.items() if k not in STEP_KEYS},
        )


def _mapping(info: Any, what: str) -> Mapping[str, Any]:
    if info is None:
        return {}
    if not isinstance(info, Mapping):
        raise EnvInfoError(f"the {what} info must be a dict (gymnasium), got {type(info).__name__}")
    return info


def _count(info: Mapping[str, Any], key: str) -> int | None:
    value = info.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise EnvInfoError(f"step info[{key!r}] must be a count (int >= 0), got {value!r}")
    return int(value)


def _number(info: Mapping[str, Any], key: str) -> float | None:
    value = info.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise EnvInfoError(f"step info[{key!r}] must be a finite number, got {value!r}")
    return float(value)


__all__ = ["RESET_KEYS", "STEP_KEYS", "EnvInfoError", "EpisodeKind", "ResetInfo", "StepInfo"]

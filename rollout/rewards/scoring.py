"""What an episode's score is: the request sent to the reward worker, the parts it returns, and
how they become the episode's reward (weighted sum; per-turn parts by turn, episode parts on the
last turn) and its metadata (``reward/<name>`` in the sample's and the trajectory's metrics).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from palaestra.types import StopReason, Trajectory


@dataclass(frozen=True)
class ScoreRequest:
    """One finished episode as the reward sources see it (picklable, no tokens)."""

    messages: tuple[Mapping[str, Any], ...]
    turns: int
    env_reward: float
    env_turn_rewards: tuple[float, ...]

    @classmethod
    def from_trajectory(cls, traj: Trajectory) -> ScoreRequest:
        return cls(tuple(m.to_dict() for m in traj.messages), len(traj.turns), float(traj.reward),
                   tuple(float(r) for r in traj.turn_rewards))


@dataclass(frozen=True)
class Part:
    """One source's score of an episode: a total, or one value per turn."""

    name: str
    weight: float
    per: str
    values: tuple[float, ...]  # one value (per = "episode") or one per turn

    @property
    def total(self) -> float:
        return float(sum(self.values))


@dataclass(frozen=True)
class ScoreResult:
    """The combined reward of one episode, or why it could not be scored."""

    reward: float = 0.0
    turn_rewards: tuple[float, ...] = ()
    parts: Mapping[str, float] = field(default_factory=dict)  # unweighted totals by name
    error: str | None = None


def combine(parts: Sequence[Part], turns: int) -> ScoreResult:
    """Weighted sum of ``parts``; ``turn_rewards`` sum to ``reward`` (when there is a turn)."""
    per_turn = [0.0] * turns
    reward = 0.0
    for part in parts:
        reward += part.weight * part.total
        if part.per == "turn":
            for k, value in enumerate(part.values[:turns]):
                per_turn[k] += part.weight * value
        elif turns:
            per_turn[-1] += part.weight * part.total
    return ScoreResult(reward, tuple(per_turn), {p.name: p.total for p in parts})


def apply_score(traj: Trajectory, result: ScoreResult) -> Trajectory:
    """``traj`` with the combined reward in it and its samples, or failed with the reason."""
    if result.error is not None:
        return replace(traj, stop_reason=StopReason.ERROR, error=f"reward: {result.error}")
    if not math.isfinite(result.reward):
        return replace(traj, stop_reason=StopReason.ERROR,
                       error=f"reward: the combined reward is not finite ({result.reward})")
    metrics = {f"reward/{name}": float(value) for name, value in result.parts.items()}
    samples = tuple(
        replace(s, reward=result.reward, turn_rewards=result.turn_rewards,
                metrics={**s.metrics, **metrics})
        for s in traj.samples
    )
    return replace(traj, reward=result.reward, samples=samples, metrics={**traj.metrics, **metrics})


def part_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """``reward/<name>``: the mean of each source's (unweighted) score over ``trajectories``."""
    sums: dict[str, list[float]] = {}
    for t in trajectories:
        for key, value in t.metrics.items():
            if key.startswith("reward/") and key.count("/") == 1:
                sums.setdefault(key, []).append(float(value))
    return {k: sum(v) / len(v) for k, v in sorted(sums.items())}


__all__ = ["Part", "ScoreRequest", "ScoreResult", "apply_score", "combine", "part_metrics"]

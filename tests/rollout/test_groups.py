"""Group filters and the failure policy (`judge_group`)."""

from __future__ import annotations

import pytest

from palaestra.errors import ConfigError
from palaestra.rollout.groups import judge_group
from palaestra.rollout.groups import resolve_filters
from palaestra.types import Sample, StopReason, Trajectory


def sample(n: int, reward: float = 0.0, group: str = "g") -> Sample:
    mask = tuple([0] * (n // 2) + [1] * (n - n // 2))
    return Sample(tuple(range(n)), mask, tuple(-0.5 * m for m in mask),
                  tuple(2 if m else -1 for m in mask), n // 2, reward=reward, group_id=group)


def traj(reward: float, stop=StopReason.TERMINATED, error=None) -> Trajectory:
    return Trajectory("env", "t", (), (), (sample(4, reward),), reward, stop, error)


def test_filters_and_failure_policy():
    filters = resolve_filters(["nonzero_variance"])
    assert judge_group([traj(1), traj(0)], filters).status == "kept"
    verdict = judge_group([traj(1), traj(1)], filters)
    assert verdict.status == "filtered" and verdict.reason == "nonzero_variance"
    failed = traj(0, StopReason.ERROR, "env.step: boom")
    mixed = judge_group([traj(1), traj(0), failed], filters)
    assert mixed.status == "kept" and len(mixed.usable) == 2  # failed episodes never train
    lost = judge_group([traj(1), failed, failed], filters, min_group_size=2)
    assert lost.status == "failed" and "boom" in lost.reason
    custom = resolve_filters([lambda ts: len(ts) > 5])
    assert judge_group([traj(1), traj(0)], custom).status == "filtered"
    with pytest.raises(ConfigError, match="unknown group filter"):
        resolve_filters(["nope"])

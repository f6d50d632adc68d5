"""Training samples from buffered groups, for a loop that reads a `TrajectoryBuffer` directly.

`samples_of_groups` applies the rollout's failure policy and group filters (`judge_group`, the
same code the `RolloutManager` runs) and returns the kept samples; ``TrainBatch.from_samples``
of `palaestra.trainers.batching` turns them into a batch. (With a `RolloutManager`, use
`palaestra.rollout.gateway.external.BufferSource` instead: posted groups then join its batches.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from palaestra.rollout.groups import GroupFilter, judge_group, resolve_filters
from palaestra.rollout.groups import GroupResult
from palaestra.types import Sample, Trajectory


@dataclass
class GroupSamples:
    """What `samples_of_groups` kept, and why the rest was left out."""

    samples: list[Sample]
    trajectories: list[Trajectory]
    counts: Counter[str] = field(default_factory=Counter)


def samples_of_groups(
    groups: Sequence[GroupResult],
    filters: Sequence[str | GroupFilter] = (),
    *,
    min_group_size: int = 1,
) -> GroupSamples:
    """The samples of the groups that pass the failure policy and the filters."""
    resolved = resolve_filters(filters)
    out = GroupSamples([], [])
    for group in groups:
        verdict = judge_group(group.trajectories, resolved, min_group_size=min_group_size)
        out.counts[f"groups/{verdict.status}"] += 1
        if verdict.status == "kept":
            out.trajectories.extend(verdict.usable)
            out.samples.extend(s for t in verdict.usable for s in t.samples)
    return out


__all__ = ["GroupSamples", "samples_of_groups"]

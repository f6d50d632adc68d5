"""Groups of n episodes per task (`GroupTask` out to a worker, `GroupResult` back, `PauseReport`
of a pause; a tree group's `Branching`: where its episodes fork), and the filters that decide which groups are trained on.

A group filter is any callable ``filter(trajectories) -> bool`` (True = keep) over the finished,
non-failed trajectories of one group. Dynamic sampling is the built-in ``"nonzero_variance"``
filter (drop groups whose rewards are all equal: their group-relative advantages are all zero);
the manager keeps drawing tasks until the batch is full of kept groups, up to a cap on draws.
`judge_group` also applies the failure policy: failed episodes (error/timeout) are recorded but
never trained on, and a group left with fewer than ``min_group_size`` usable episodes fails.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from palaestra.errors import ConfigError
from palaestra.types import Trajectory

GroupFilter = Callable[[Sequence[Trajectory]], bool]


@dataclass(frozen=True)
class Branching:
    """Where a group's episodes fork (0-based turn indices, increasing) and into how many."""

    turns: tuple[int, ...]
    width: int

    def __post_init__(self) -> None:
        turns = tuple(int(t) for t in self.turns)
        if any(t < 0 for t in turns) or list(turns) != sorted(set(turns)):
            raise ConfigError(f"branching turns must be increasing turn indices >= 0, got "
                              f"{list(self.turns)}")
        if int(self.width) < 1:
            raise ConfigError(f"branching width must be >= 1, got {self.width}")
        object.__setattr__(self, "turns", turns)
        object.__setattr__(self, "width", int(self.width))

    @property
    def leaves_per_root(self) -> int:
        return self.width ** len(self.turns)

    def roots(self, group_size: int) -> int:
        """Root episodes of a group of ``group_size`` leaves (`ConfigError` if not whole)."""
        if group_size % self.leaves_per_root:
            raise ConfigError(
                f"a group of {group_size} leaves cannot be split into trees of width "
                f"{self.width} forking at turns {list(self.turns)} ({self.leaves_per_root} "
                "leaves per root); make group_size a multiple of width ** len(turns)")
        return group_size // self.leaves_per_root



def nonzero_variance(trajectories: Sequence[Trajectory], eps: float = 1e-8) -> bool:
    """Keep a group whose rewards differ (GRPO-style advantages are all zero otherwise)."""
    rewards = [t.reward for t in trajectories]
    if len(rewards) < 2:
        return False
    mean = sum(rewards) / len(rewards)
    return math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) > eps


def any_success(trajectories: Sequence[Trajectory]) -> bool:
    """Keep a group where at least one episode earned a positive reward."""
    return any(t.reward > 0 for t in trajectories)


BUILTIN_FILTERS: dict[str, GroupFilter] = {
    "nonzero_variance": nonzero_variance,
    "any_success": any_success,
}


def resolve_filters(specs: Sequence[str | GroupFilter]) -> list[tuple[str, GroupFilter]]:
    """(name, filter) pairs from built-in names or callables; names label the metrics."""
    out: list[tuple[str, GroupFilter]] = []
    for spec in specs:
        if isinstance(spec, str):
            if spec not in BUILTIN_FILTERS:
                raise ConfigError(
                    f"unknown group filter {spec!r}; use one of {sorted(BUILTIN_FILTERS)} or "
                    "pass a callable(trajectories) -> bool"
                )
            out.append((spec, BUILTIN_FILTERS[spec]))
        elif callable(spec):
            out.append((getattr(spec, "__name__", type(spec).__name__), spec))
        else:
            raise ConfigError(f"a group filter must be a name or a callable, got {spec!r}")
    return out


@dataclass(frozen=True)
class GroupVerdict:
    """What happens to one finished group."""

    status: str  # "kept" | "filtered" | "failed"
    usable: tuple[Trajectory, ...]  # the non-failed trajectories with samples
    reason: str = ""  # the filter name, or the failure summary


def judge_group(
    trajectories: Sequence[Trajectory],
    filters: Sequence[tuple[str, GroupFilter]],
    *,
    min_group_size: int = 1,
) -> GroupVerdict:
    """Apply the failure policy, then the filters, to one finished group."""
    usable = tuple(t for t in trajectories if not t.failed and t.samples)
    if len(usable) < min_group_size:
        errors = sorted({(t.error or t.stop_reason.value)[:200] for t in trajectories if t.failed})
        return GroupVerdict("failed", usable, "; ".join(errors[:3]))
    for name, keep in filters:
        if not keep(usable):
            return GroupVerdict("filtered", usable, name)
    return GroupVerdict("kept", usable)


# ---------------------------------------------------------------------- group data types
@dataclass(frozen=True)
class GroupTask:
    """One task to play ``len(seeds)`` times."""

    group_id: str
    env_id: str
    task: dict[str, Any]
    task_id: str
    seeds: tuple[int, ...]
    #: play the group as trees that fork at these turns (`palaestra.rollout.branching`); the
    #: seeds are then one per leaf
    branching: Branching | None = None


@dataclass(frozen=True)
class GroupResult:
    """The finished episodes of one group."""

    group_id: str
    trajectories: tuple[Trajectory, ...]
    worker: int


@dataclass(frozen=True)
class PauseReport:
    """What one worker's `RolloutWorker.pause` parked."""

    parked_groups: int
    parked_episodes: int


__all__ = [
    "BUILTIN_FILTERS",
    "Branching",
    "GroupFilter",
    "GroupResult",
    "GroupTask",
    "GroupVerdict",
    "PauseReport",
    "any_success",
    "judge_group",
    "nonzero_variance",
    "resolve_filters",
]

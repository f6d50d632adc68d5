"""`TrajectoryBuffer`: finished trajectories from external generators, grouped for training.

Trajectories arrive from ``POST /trajectories`` (validated by
`palaestra.rollout.gateway.validation`), from a gateway session's ``/finish``, or in process
(`add_trajectories`). They collect per group id; a group is complete when it holds its size
(``group_size`` of the post, else the buffer's), or, with no size anywhere, when the post that
brought it ends. Complete groups leave in arrival order as `GroupResult`s, the unit the rollout
manager judges and batches:

- `take` / `wait_groups`: for a training loop that reads the buffer directly;
- `palaestra.rollout.gateway.external.BufferSource`: a data source the `RolloutManager` draws
  from, so posted groups join batches like any other group (filters, failure policy, staleness,
  the ledger of drawn tasks).

Like slime's rollout buffer, but every post is validated before anything is stored (every
problem of it reported at once), a post is taken whole or not at all, a group never takes more
trajectories than its size, and sizes are capped (`PostLimits`: tokens per sample, samples per
trajectory, metadata bytes, trajectories per group). `parse` is pure (the server runs it in a
worker thread, off the event loop) and `store` keeps what it returned.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from palaestra.errors import ConfigError
from palaestra.rollout.gateway.validation import BufferConflictError, PostLimits, parse_post
from palaestra.rollout.groups import GroupResult
from palaestra.types import Trajectory

# name -> live buffer, for in-process workers that reach a buffer by its name (a worker config
# travels as data, not as the object). Weak values: a buffer that its run dropped leaves the
# registry with it, and a later run's buffer of the same name replaces it, so a second run in the
# process never claims from the first run's buffer.
_BUFFERS: weakref.WeakValueDictionary[str, TrajectoryBuffer] = weakref.WeakValueDictionary()


@dataclass
class _Group:
    size: int | None
    trajectories: list[Trajectory] = field(default_factory=list)
    complete: bool = False
    created: float = field(default_factory=time.time)


class TrajectoryBuffer:
    """Validated external trajectories, grouped; see the module docstring.

    ``vocab_size`` bounds token ids (the policy's vocabulary); ``version`` is the policy version
    given to sampled tokens of posts without ``versions`` (set it after each weight update);
    ``name`` registers the buffer in this process for `BufferSource` and the external env.
    ``max_tokens`` (tokens per sample; the gateway passes the policy's context),
    ``max_samples``, ``max_metadata_bytes`` and ``max_group_size`` bound what a post may hold
    (None: unbounded); see `PostLimits`.
    """

    def __init__(
        self,
        *,
        vocab_size: int | None,
        group_size: int | None = None,
        max_tokens: int | None = None,
        max_samples: int | None = PostLimits.max_samples,
        max_metadata_bytes: int | None = PostLimits.max_metadata_bytes,
        max_group_size: int | None = PostLimits.max_group_size,
        max_open_groups: int = 100_000,
        version: int = 0,
        name: str | None = None,
    ) -> None:
        if group_size is not None and group_size < 1:
            raise ConfigError(f"group_size must be >= 1, got {group_size}")
        for field_name, cap in (("max_tokens", max_tokens), ("max_samples", max_samples),
                                ("max_metadata_bytes", max_metadata_bytes),
                                ("max_group_size", max_group_size)):
            if cap is not None and cap < 1:
                raise ConfigError(f"{field_name} must be >= 1 or None (unbounded), got {cap}")
        if group_size is not None and max_group_size is not None and group_size > max_group_size:
            raise ConfigError(f"group_size {group_size} exceeds max_group_size {max_group_size}")
        self.vocab_size = vocab_size
        self.group_size = group_size
        self.max_tokens = max_tokens
        self.max_samples = max_samples
        self.max_metadata_bytes = max_metadata_bytes
        self.max_group_size = max_group_size
        self.max_open_groups = max_open_groups
        self.version = version
        self._groups: OrderedDict[str, _Group] = OrderedDict()
        self._ready: deque[str] = deque()
        self._closed_ids: set[str] = set()  # groups already handed out
        self._claims: dict[str, list[Trajectory]] = {}
        self._changed: asyncio.Event | None = None
        self.counters: Counter[str] = Counter()
        self.name = name
        if name is not None:
            _BUFFERS[name] = self

    @staticmethod
    def named(name: str) -> TrajectoryBuffer:
        """The buffer registered under ``name`` in this process."""
        buffer = _BUFFERS.get(name)
        if buffer is None:
            raise ConfigError(f"no trajectory buffer named {name!r} in this process; create it "
                              "with TrajectoryBuffer(name=...) or give the buffer server's URL")
        return buffer

    # ------------------------------------------------------------------ adding
    @property
    def limits(self) -> PostLimits:
        return PostLimits(vocab_size=self.vocab_size, max_tokens=self.max_tokens,
                          max_samples=self.max_samples,
                          max_metadata_bytes=self.max_metadata_bytes,
                          max_group_size=self.max_group_size)

    def add(self, payload: object) -> dict[str, Any]:
        """Validate and store one ``POST /trajectories`` body (all of it or nothing)."""
        try:
            parsed = self.parse(payload)
        except Exception:
            self.reject()
            raise
        return self.store(*parsed)

    def parse(self, payload: object) -> tuple[list[tuple[str, Trajectory]], int | None]:
        """Validate a post against the buffer's limits (pure; safe in a worker thread)."""
        return parse_post(payload, version=self.version, limits=self.limits)

    def reject(self) -> None:
        """Count a refused post (`parse` raised)."""
        self.counters["rejected_posts"] += 1

    def store(self, items: Sequence[tuple[str, Trajectory]], size: int | None
              ) -> dict[str, Any]:
        """Store the trajectories `parse` returned, all or none (conflicts raise before any)."""
        by_group: OrderedDict[str, list[Trajectory]] = OrderedDict()
        for gid, traj in items:
            by_group.setdefault(gid, []).append(traj)
        for gid, trajs in by_group.items():  # check every group before storing any
            self._check_fits(gid, len(trajs), size)
        results = [self.add_trajectories(gid, trajs, size) for gid, trajs in by_group.items()]
        return {"accepted": len(items), "groups": results}

    def add_trajectories(
        self, group_id: str, trajectories: Sequence[Trajectory], group_size: int | None = None
    ) -> dict[str, Any]:
        """Store already validated trajectories of one group (in-process producers)."""
        self._check_fits(group_id, len(trajectories), group_size)
        group = self._groups.get(group_id)
        if group is None:
            group = self._groups[group_id] = _Group(group_size or self.group_size)
        group.trajectories.extend(_regroup(t, group_id) for t in trajectories)
        self.counters["trajectories"] += len(trajectories)
        if group.size is None or len(group.trajectories) >= group.size:
            group.complete = True
            self._ready.append(group_id)
            self.counters["groups_completed"] += 1
            if self._changed is not None:
                self._changed.set()
        return {"group_id": group_id, "trajectories": len(group.trajectories),
                "group_size": group.size, "complete": group.complete}

    def _check_fits(self, group_id: str, count: int, size: int | None) -> None:
        if group_id in self._closed_ids:
            raise BufferConflictError(
                f"group {group_id!r} was already handed to training; use a new group id")
        group = self._groups.get(group_id)
        expected = group.size if group is not None else (size or self.group_size)
        if group is not None and group.complete:
            raise BufferConflictError(f"group {group_id!r} is already complete")
        if group is not None and size is not None and group.size not in (None, size):
            raise BufferConflictError(
                f"group {group_id!r} was started with group_size={group.size}, not {size}")
        have = len(group.trajectories) if group is not None else 0
        if self.max_group_size is not None and have + count > self.max_group_size:
            raise BufferConflictError(
                f"group {group_id!r} would hold {have + count} trajectories; a group holds at "
                f"most {self.max_group_size} (max_group_size)")
        if expected is not None and have + count > expected:
            raise BufferConflictError(
                f"group {group_id!r} would hold {have + count} trajectories; its size is "
                f"{expected}")
        if group is None and len(self._groups) >= self.max_open_groups:
            raise BufferConflictError(
                f"the buffer holds {self.max_open_groups} groups; wait for training to take some")

    # ------------------------------------------------------------------ taking
    def ready_count(self) -> int:
        return len(self._ready)

    def take(self, max_groups: int | None = None) -> list[GroupResult]:
        """Complete groups, oldest first (at most ``max_groups``), removed from the buffer."""
        out: list[GroupResult] = []
        while self._ready and (max_groups is None or len(out) < max_groups):
            gid = self._ready.popleft()
            group = self._groups.pop(gid)
            self._closed_ids.add(gid)
            out.append(GroupResult(gid, tuple(group.trajectories), -1))
        self.counters["groups_taken"] += len(out)
        return out

    async def wait_groups(self, n: int, timeout_s: float | None = None) -> list[GroupResult]:
        """Wait until ``n`` groups are complete (or the timeout) and take up to ``n``."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while len(self._ready) < n:
            if self._changed is None:
                self._changed = asyncio.Event()
            self._changed.clear()
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                break
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                break
        return self.take(n)

    def reserve(self) -> tuple[str, int] | None:
        """Move the oldest complete group to the claim area: ``(group_id, size)`` or None.

        `BufferSource` calls this to turn a group into a rollout task; each episode of that
        task then `claim`s one of its trajectories.
        """
        taken = self.take(1)
        if not taken:
            return None
        result = taken[0]
        self._claims[result.group_id] = list(result.trajectories)
        return result.group_id, len(result.trajectories)

    def claim(self, group_id: str) -> Trajectory:
        """One trajectory of a reserved group (each is handed out once)."""
        left = self._claims.get(group_id)
        if not left:
            raise BufferConflictError(
                f"group {group_id!r} has no trajectory left to claim (reserved groups hand out "
                "each trajectory once; is the rollout group_size larger than the posted group?)")
        traj = left.pop(0)
        if not left:
            del self._claims[group_id]
        return traj

    def stats(self) -> dict[str, Any]:
        open_groups = sum(1 for g in self._groups.values() if not g.complete)
        return {**{k: int(v) for k, v in self.counters.items()}, "ready_groups": len(self._ready),
                "open_groups": open_groups, "claimable_groups": len(self._claims),
                "version": self.version}


def _regroup(traj: Trajectory, group_id: str) -> Trajectory:
    if traj.group_id == group_id and all(s.group_id == group_id for s in traj.samples):
        return traj
    samples = tuple(replace(s, group_id=group_id) for s in traj.samples)
    return replace(traj, group_id=group_id, samples=samples)


__all__ = ["TrajectoryBuffer"]

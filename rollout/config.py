"""Rollout settings: how workers reach engines (`EngineSpec`), what a worker runs (`WorkerConfig`)
and how the manager forms batches (`RolloutConfig`).

Engines, as seen from a worker, are either *shared* servers reached over HTTP
(``EngineSpec.http(urls)``: `palaestra serve` or SGLang; each worker holds a `Router` of
`SGLangClient`s and the manager holds one more for pause/weight update/resume), or *owned*
instances that every worker builds for itself from a picklable factory
(``EngineSpec.from_factory(fn)``: the scripted engine of tests and benchmarks, or an embedded
engine per worker); the manager then forwards weight updates to every worker. In ``local`` mode
the manager can also be given one live engine object that all in-process workers share.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from palaestra.errors import ConfigError
from palaestra.rollout.engines.base import Engine, SamplingParams
from palaestra.rollout.groups import GroupFilter


@dataclass(frozen=True)
class EngineSpec:
    """How a worker process reaches its engine(s); picklable (it travels to Ray actors)."""

    urls: tuple[str, ...] = ()
    factory: Callable[[], Engine] | None = None
    client_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def http(cls, urls: Sequence[str], **client_kwargs: Any) -> EngineSpec:
        """Shared engine servers (SGLang or `palaestra serve`) behind a sticky-session router."""
        if not urls:
            raise ConfigError("EngineSpec.http needs at least one engine URL")
        return cls(urls=tuple(urls), client_kwargs=dict(client_kwargs))

    @classmethod
    def from_factory(cls, factory: Callable[[], Engine]) -> EngineSpec:
        """An engine that each worker builds and owns (must be picklable for Ray workers)."""
        if not callable(factory):
            raise ConfigError("EngineSpec.from_factory needs a zero-argument callable")
        return cls(factory=factory)

    @property
    def owned(self) -> bool:
        return self.factory is not None

    def build(self) -> Engine:
        if self.factory is not None:
            return self.factory()
        from palaestra.rollout.engines import Router, SGLangClient

        kwargs = dict(self.client_kwargs)
        router_kwargs = kwargs.pop("router", {})
        return Router([SGLangClient(url, **kwargs) for url in self.urls], **router_kwargs)


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a rollout worker needs to run episodes (picklable)."""

    engine: EngineSpec
    agent: Any  # an AgentSpec (with .build()) or a picklable zero-argument callable -> Agent
    sampling: SamplingParams = field(default_factory=SamplingParams)
    env_kwargs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # per env id
    max_turns: int | None = None
    step_timeout_s: float | None = None
    seed_sampling: bool = False  # SamplingParams.seed from the episode seed (reproducible)
    partial_rollout: bool = True  # resume aborted generations from their tokens
    tool_cache: tuple[str, str] | None = None  # (path, mode) of a record/replay cache
    poll_s: float = 0.05  # longest a worker's exchange call waits for results
    linger_s: float = 0.002  # after the first result, wait this long to batch more


@dataclass(frozen=True)
class RolloutConfig:
    """How the manager turns tasks into batches."""

    batch_size: int = 64  # groups per batch
    group_size: int = 4  # episodes per task
    max_concurrency: int = 256  # episodes in flight over all workers
    over_sampling: float = 1.0  # groups in flight = ceil(missing groups x this), capped above
    filters: tuple[str | GroupFilter, ...] = ()  # e.g. ("nonzero_variance",): dynamic sampling
    max_draw_factor: float = 4.0  # at most ceil(batch_size x this) tasks drawn per step
    min_group_size: int = 1  # fewer usable (non-failed) episodes -> the group fails
    max_failure_rate: float = 0.5  # failed / finished episodes above this -> RolloutError
    mode: str = "sync"  # "sync" | "async" (batch k+1 generated while k trains)
    max_staleness: int = 1  # newest version - oldest token version allowed in a batch
    stale_action: str = "requeue"  # "requeue" (regenerate the task) | "drop"
    pause_between_batches: bool | None = None  # default: True in sync mode, False in async
    pass_threshold: float = 1.0
    num_workers: int = 2
    worker_num_cpus: float = 1.0

    def __post_init__(self) -> None:
        problems = []
        for name in ("batch_size", "group_size", "max_concurrency", "num_workers", "min_group_size"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.over_sampling < 1.0:
            problems.append(f"over_sampling must be >= 1.0 (got {self.over_sampling})")
        if self.max_draw_factor < 1.0:
            problems.append(f"max_draw_factor must be >= 1.0 (got {self.max_draw_factor})")
        if not 0.0 <= self.max_failure_rate <= 1.0:
            problems.append(f"max_failure_rate must be in [0, 1] (got {self.max_failure_rate})")
        if self.mode not in ("sync", "async"):
            problems.append(f"mode must be 'sync' or 'async' (got {self.mode!r})")
        if self.max_staleness < 0:
            problems.append(f"max_staleness must be >= 0 (got {self.max_staleness})")
        if self.stale_action not in ("requeue", "drop"):
            problems.append(f"stale_action must be 'requeue' or 'drop' (got {self.stale_action!r})")
        if self.min_group_size > self.group_size:
            problems.append(
                f"min_group_size ({self.min_group_size}) exceeds group_size ({self.group_size})"
            )
        if self.max_concurrency < self.group_size:
            problems.append(
                f"max_concurrency ({self.max_concurrency}) must fit one group ({self.group_size})"
            )
        if problems:
            raise ConfigError("invalid rollout config:\n  - " + "\n  - ".join(problems))

    @property
    def max_inflight_groups(self) -> int:
        return max(1, self.max_concurrency // self.group_size)

    @property
    def max_draws(self) -> int:
        return math.ceil(self.batch_size * self.max_draw_factor)

    @property
    def pauses_between_batches(self) -> bool:
        if self.pause_between_batches is not None:
            return self.pause_between_batches
        return self.mode == "sync"


__all__ = ["EngineSpec", "RolloutConfig", "WorkerConfig"]

"""Rollout settings: how workers reach engines (`EngineSpec`), what a worker runs (`WorkerConfig`)
and how rollout forms batches (`RolloutConfig`: the one rollout settings object, ``[rollout]``
of ``palaestra train`` and the manager's config alike).

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
from typing import TYPE_CHECKING, Any, Literal

import pydantic
from pydantic import Field
from pydantic._internal._model_construction import ModelMetaclass  # pydantic.main uses it too

from palaestra.config import Problem, Section
from palaestra.errors import ConfigError
from palaestra.rollout.branching import BranchingConfig
from palaestra.engine import Engine, SamplingParams
from palaestra.rollout.groups import GroupFilter

if TYPE_CHECKING:
    from palaestra.agents import Agent, AgentSpec


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
        from palaestra.engines.clients.router import Router
        from palaestra.engines.clients.sglang_client import SGLangClient

        kwargs = dict(self.client_kwargs)
        router_kwargs = kwargs.pop("router", {})
        return Router([SGLangClient(url, **kwargs) for url in self.urls], **router_kwargs)


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a rollout worker needs to run episodes (picklable)."""

    engine: EngineSpec
    # an AgentSpec (built with the worker's rng) or a picklable zero-argument callable -> Agent
    agent: AgentSpec | Callable[[], Agent]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    env_kwargs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # per env id
    max_turns: int | None = None
    step_timeout_s: float | None = None
    seed_sampling: bool = False  # SamplingParams.seed from the episode seed (reproducible)
    partial_rollout: bool = True  # resume aborted generations from their tokens
    tool_cache: tuple[str, str] | None = None  # (path, mode) of a record/replay cache
    poll_s: float = 0.05  # longest a worker's exchange call waits for results
    linger_s: float = 0.002  # after the first result, wait this long to batch more
    # a `palaestra.rollout.rewards.RewardClient`: scores each finished episode ([[rewards]])
    rewards: Any = None


class _ConfigErrorOnCall(ModelMetaclass):
    """``RolloutConfig(...)`` in code raises one `ConfigError` listing every problem (fields and
    `rollout_problems`). Only a direct call goes through here: as a section of a loaded config
    the model is validated inside its parent, whose loader reports pydantic's errors with their
    dotted paths (``rollout.batch_size = 0: must be >= 1``) and runs `rollout_problems` itself."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        try:
            config = super().__call__(*args, **kwargs)
        except pydantic.ValidationError as exc:
            raise _invalid([
                f"{'.'.join(str(p) for p in err['loc'])} = {err.get('input')!r}: {err['msg']}"
                for err in exc.errors()
            ]) from None
        config.check()
        return config


class RolloutConfig(Section, metaclass=_ConfigErrorOnCall):
    """How rollout runs: groups and batches (the manager), sampling, workers, sync/async.

    The one rollout settings object: ``[rollout]`` of ``palaestra train`` (checked when the
    config loads, by field and by `rollout_problems`) and the `RolloutManager`'s own config
    (checked when built: a `ConfigError` lists every problem).
    """

    batch_size: int = Field(16, ge=1)
    """Groups (prompts) per training step."""
    group_size: int = Field(8, ge=1)
    """Episodes per prompt (group baselines such as GRPO's need 2 or more)."""
    max_new_tokens: int = Field(256, ge=1)
    """Token budget of one assistant turn."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature (the trainer divides logits by it to match)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling."""
    max_turns: int | None = Field(None, ge=1)
    """Cap on assistant turns per episode (None: the env's own limit)."""
    cluster: Literal["ray", "local"] = "ray"
    """Rollout workers as Ray actors, or in-process asyncio workers ("local")."""
    ray_address: str | None = None
    """Address of an existing Ray cluster (None: start a local one)."""
    num_workers: int = Field(2, ge=1)
    """Rollout workers."""
    worker_num_cpus: float = Field(1.0, gt=0.0)
    """CPUs Ray reserves for each rollout worker actor."""
    start_timeout_s: float = Field(60.0, gt=0.0)
    """Seconds the run's Ray actors (rollout workers) and placement groups (trainer ranks) may
    take to start; one still pending then (the cluster has no room for it) fails the run with
    what it asked and what the cluster has, instead of waiting forever."""
    max_concurrency: int = Field(256, ge=1)
    """Episodes in flight over all workers."""
    mode: Literal["sync", "async"] = "sync"
    """sync: rollout then train; async: rollout of step k+1 overlaps training of step k."""
    max_staleness: int = Field(1, ge=0)
    """Oldest policy version a trained token may have, counted back from the newest."""
    stale_action: Literal["requeue", "drop"] = "requeue"
    """A group older than ``max_staleness``: regenerate its task ("requeue") or drop it."""
    pause_between_batches: bool | None = None
    """Park in-flight episodes while the trainer works (None: in sync mode, not in async)."""
    filters: tuple[str | GroupFilter, ...] = ()
    """Group filters, e.g. ["nonzero_variance"] (dynamic sampling); in code also callables
    ``filter(trajectories) -> bool``."""
    max_draw_factor: float = Field(4.0, ge=1.0)
    """At most ceil(batch_size x this) tasks drawn per step (filters drop groups)."""
    min_group_size: int = Field(1, ge=1)
    """A group left with fewer usable (non-failed) episodes fails."""
    max_failure_rate: float = Field(0.5, ge=0.0, le=1.0)
    """Failed episodes above this fraction fail the step."""
    over_sampling: float = Field(1.0, ge=1.0)
    """Groups started per missing group (>1 when filters drop many groups)."""
    pass_threshold: float = 1.0
    """Reward at or above which an episode counts as passed (``pass@k`` metrics)."""
    branching: BranchingConfig | None = None
    """Play each group as trees: episodes share their first turns and fork before the given
    turns into ``width`` branches (``{turns = [1, 2], width = 2}``); group_size counts leaves
    (`palaestra.rollout.branching`; train them with trainer.loss.advantage_estimator = "tree")."""

    def check(self) -> None:
        """Raise `ConfigError` when the settings do not fit together (`rollout_problems`)."""
        problems = rollout_problems(self, prefix="")
        if problems:
            raise _invalid([p.message for p in problems])

    def sampling(self, temperature: float | None = None) -> SamplingParams:
        """The sampling settings of rollout (``temperature`` for e.g. a greedy evaluation)."""
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature if temperature is None else temperature,
            top_p=self.top_p,
        )

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


def _invalid(lines: Sequence[str]) -> ConfigError:
    return ConfigError("invalid rollout config:\n  - " + "\n  - ".join(lines))


def rollout_problems(r: RolloutConfig, prefix: str = "rollout.") -> list[Problem]:
    """What the field types alone do not catch; ``prefix`` names the section in messages."""
    from palaestra.rollout.groups import BUILTIN_FILTERS

    out = []
    if r.max_concurrency < r.group_size:
        out.append(Problem((f"{prefix}max_concurrency", f"{prefix}group_size"), (
            f"{prefix}max_concurrency = {r.max_concurrency} cannot hold one group of "
            f"{prefix}group_size = {r.group_size} episodes; raise max_concurrency to at least "
            f"{r.group_size}")))
    if r.min_group_size > r.group_size:
        out.append(Problem((f"{prefix}min_group_size", f"{prefix}group_size"), (
            f"{prefix}min_group_size = {r.min_group_size} exceeds {prefix}group_size = "
            f"{r.group_size}: every group would fail; lower min_group_size")))
    if r.branching is not None and r.group_size % r.branching.spec().leaves_per_root:
        per_root = r.branching.spec().leaves_per_root
        out.append(Problem((f"{prefix}branching", f"{prefix}group_size"), (
            f"{prefix}group_size = {r.group_size} leaves cannot be split into trees of "
            f"{per_root} leaves ({prefix}branching: width {r.branching.width} ** "
            f"{len(r.branching.turns)} branch turns); make group_size a multiple of {per_root}")))
    unknown = [f for f in r.filters if isinstance(f, str) and f not in BUILTIN_FILTERS]
    if unknown:
        out.append(Problem((f"{prefix}filters",), (
            f"{prefix}filters: unknown filter(s) {unknown}; use {sorted(BUILTIN_FILTERS)} (or, "
            "in code, a callable(trajectories) -> bool)")))
    return out


__all__ = ["EngineSpec", "RolloutConfig", "WorkerConfig", "rollout_problems"]

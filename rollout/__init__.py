"""Rollout: tasks -> groups of episodes -> scored, token-exact samples, fast and without loss.

`play_episode(EpisodeRequest)` is the one episode loop (`run_episode`: its token-level call); `RolloutManager` runs it at scale on rollout
workers (Ray actors, or in-process with ``cluster="local"``) and hands the trainer
`RolloutBatch`es. Importing this package is light: names load on first use, and nothing here
imports ray or torch until a function needs it.

Engines and Ray workers: engines run as HTTP servers (SGLang in production, `palaestra serve`
with the embedded engine otherwise) and every worker reaches them through a `Router` of
`SGLangClient`s (``EngineSpec.http(urls)``): sticky sessions keep an episode's turns on one
engine's prefix cache, a dead engine's requests are retried on another, and the manager holds
one more client for pause / weight update / resume. Engines that are cheap to copy (the scripted
engine of tests and benchmarks) can instead be built inside each worker
(``EngineSpec.from_factory``), and ``cluster="local"`` can share one live engine object. Engines
are not wrapped as Ray actors: the HTTP path is the one SGLang needs anyway, and it keeps weight
updates, aborts and failover in one place.

Modules: `episode` (the loop), `data` (data source), `groups` (filters), `worker` / `cluster` /
`manager` (scale-out and batches), `tool_cache` (record/replay), `metrics`, `config`, `testing`
(scripted policies and faulty envs for tests and benchmarks). GPU placement plans live in
`palaestra.run.fleet.placement`. Samples become tensors in `palaestra.trainers.batching` (DP balance,
micro-batches).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the lazy exports for type checkers; at run time `__getattr__` loads them
    from palaestra.rollout.cluster import (
        WorkerPool as WorkerPool,
    )
    from palaestra.rollout.config import (
        EngineSpec as EngineSpec,
    )
    from palaestra.rollout.config import (
        RolloutConfig as RolloutConfig,
    )
    from palaestra.rollout.config import (
        WorkerConfig as WorkerConfig,
    )
    from palaestra.rollout.data import (
        DataSource as DataSource,
    )
    from palaestra.rollout.data import (
        TaskItem as TaskItem,
    )
    from palaestra.rollout.data import (
        load_rows as load_rows,
    )
    from palaestra.rollout.episode import (
        EpisodeRequest as EpisodeRequest,
    )
    from palaestra.rollout.episode import (
        EpisodeState as EpisodeState,
    )
    from palaestra.rollout.episode import (
        TokenPlayer as TokenPlayer,
    )
    from palaestra.rollout.play import (
        play_episode as play_episode,
    )
    from palaestra.rollout.play import (
        run_episode as run_episode,
    )
    from palaestra.rollout.groups import (
        GroupFilter as GroupFilter,
    )
    from palaestra.rollout.groups import (
        judge_group as judge_group,
    )
    from palaestra.rollout.groups import (
        nonzero_variance as nonzero_variance,
    )
    from palaestra.rollout.manager import (
        RolloutBatch as RolloutBatch,
    )
    from palaestra.rollout.manager import (
        RolloutManager as RolloutManager,
    )
    from palaestra.rollout.metrics import (
        summarize as summarize,
    )
    from palaestra.rollout.tool_cache import (
        ToolCache as ToolCache,
    )
    from palaestra.rollout.groups import (
        GroupResult as GroupResult,
    )
    from palaestra.rollout.groups import (
        GroupTask as GroupTask,
    )
    from palaestra.rollout.worker import (
        RolloutWorker as RolloutWorker,
    )

_EXPORTS = {
    "run_episode": "palaestra.rollout.play",
    "EpisodeState": "palaestra.rollout.episode",
    "EpisodeRequest": "palaestra.rollout.episode",
    "TokenPlayer": "palaestra.rollout.episode",
    "play_episode": "palaestra.rollout.play",
    "DataSource": "palaestra.rollout.data",
    "TaskItem": "palaestra.rollout.data",
    "load_rows": "palaestra.rollout.data",
    "GroupFilter": "palaestra.rollout.groups",
    "nonzero_variance": "palaestra.rollout.groups",
    "judge_group": "palaestra.rollout.groups",
    "EngineSpec": "palaestra.rollout.config",
    "RolloutConfig": "palaestra.rollout.config",
    "WorkerConfig": "palaestra.rollout.config",
    "RolloutManager": "palaestra.rollout.manager",
    "RolloutBatch": "palaestra.rollout.manager",
    "RolloutWorker": "palaestra.rollout.worker",
    "GroupTask": "palaestra.rollout.groups",
    "GroupResult": "palaestra.rollout.groups",
    "ToolCache": "palaestra.rollout.tool_cache",
    "summarize": "palaestra.rollout.metrics",
    "WorkerPool": "palaestra.rollout.cluster",
}

__all__ = [
    "DataSource",
    "EngineSpec",
    "EpisodeRequest",
    "EpisodeState",
    "GroupFilter",
    "GroupResult",
    "GroupTask",
    "RolloutBatch",
    "RolloutConfig",
    "RolloutManager",
    "RolloutWorker",
    "TaskItem",
    "TokenPlayer",
    "ToolCache",
    "WorkerConfig",
    "WorkerPool",
    "judge_group",
    "load_rows",
    "nonzero_variance",
    "play_episode",
    "run_episode",
    "summarize",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'palaestra.rollout' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

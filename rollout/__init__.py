"""Rollout: tasks -> groups of episodes -> scored, token-exact samples, fast and without loss.

`run_episode` is the one env/agent/engine loop; `RolloutManager` runs it at scale on rollout
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
`manager` (scale-out and batches), `tool_cache` (record/replay), `batching` (DP balance,
micro-batches, tensors), `metrics`, `placement` (GPU plans), `config`, `testing` (scripted
policies and faulty envs for tests and benchmarks).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "run_episode": "palaestra.rollout.episode",
    "EpisodeState": "palaestra.rollout.episode",
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
    "GroupTask": "palaestra.rollout.worker",
    "GroupResult": "palaestra.rollout.worker",
    "ToolCache": "palaestra.rollout.tool_cache",
    "balance_by_tokens": "palaestra.rollout.batching",
    "micro_batches": "palaestra.rollout.batching",
    "collate": "palaestra.rollout.batching",
    "summarize": "palaestra.rollout.metrics",
    "plan_placement": "palaestra.rollout.placement",
    "PlacementPlan": "palaestra.rollout.placement",
    "PlacementConfig": "palaestra.rollout.placement",
    "WorkerPool": "palaestra.rollout.cluster",
}

__all__ = [
    "DataSource",
    "EngineSpec",
    "EpisodeState",
    "GroupFilter",
    "GroupResult",
    "GroupTask",
    "PlacementConfig",
    "PlacementPlan",
    "RolloutBatch",
    "RolloutConfig",
    "RolloutManager",
    "RolloutWorker",
    "TaskItem",
    "ToolCache",
    "WorkerConfig",
    "WorkerPool",
    "balance_by_tokens",
    "collate",
    "judge_group",
    "load_rows",
    "micro_batches",
    "nonzero_variance",
    "plan_placement",
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

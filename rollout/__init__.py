"""Rollout: tasks -> groups of episodes -> scored, token-exact samples, fast and without loss.

`run_episode` is the one env/agent/engine loop; `RolloutManager` runs it at scale on rollout
workers (Ray actors, or in-process with ``cluster="local"``) and hands the trainer
`RolloutBatch`es. Importing this package is light: names load on first use, and nothing here
imports ray or torch until a function needs it.
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

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'palaestra.rollout' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

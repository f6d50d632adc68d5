"""The public rollout API stays put, and importing it stays light (no ray, torch, transformers)."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

from palaestra import rollout
from palaestra.rollout import RolloutBatch, RolloutManager, run_episode


def test_public_names():
    assert {
        "run_episode", "EpisodeState", "DataSource", "RolloutManager", "RolloutBatch",
        "RolloutConfig", "WorkerConfig", "EngineSpec", "WorkerPool", "RolloutWorker",
        "ToolCache",
        "nonzero_variance",
    } <= set(rollout.__all__)
    from palaestra.run.fleet import placement  # GPU plans belong to the run, not to the rollout

    assert {"plan_placement", "PlacementConfig", "PlacementPlan"} <= set(placement.__all__)
    for name in rollout.__all__:
        assert getattr(rollout, name) is not None


def test_signatures_the_training_loop_uses():
    params = inspect.signature(run_episode).parameters
    assert list(params)[:4] == ["env", "agent", "engine", "sampling"]
    assert {"seed", "task", "session_id", "max_turns", "state"} <= set(params)
    assert list(inspect.signature(RolloutManager.generate_batch).parameters) == ["self", "step"]
    assert {"state_dict", "path", "version"} <= set(
        inspect.signature(RolloutManager.update_weights).parameters)
    assert list(inspect.signature(RolloutManager.weights_paused).parameters) == [
        "self", "version"]
    fields = {f.name for f in dataclasses.fields(RolloutBatch)}
    assert {"samples", "trajectories", "metrics", "version", "failed"} <= fields


def test_import_is_light():
    code = ("import sys, palaestra.rollout as r\n"
            "from palaestra.rollout import RolloutManager, run_episode, DataSource, ToolCache\n"
            "from palaestra.run.fleet.placement import plan_placement\n"
            "print(','.join(m for m in ('ray', 'torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""

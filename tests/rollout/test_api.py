"""The public rollout API stays put, and importing it stays light (no ray, torch, transformers)."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

from palaestra.rollout.manager import RolloutBatch, RolloutManager
from palaestra.rollout.play import run_episode


def test_public_names():
    """The rollout API, each name in the module that defines it (the package exports nothing)."""
    from palaestra.rollout import cluster, config, data, episode, groups, manager, play
    from palaestra.rollout import tool_cache, worker

    public = {play: {"run_episode", "play_episode"}, episode: {"EpisodeState"},
              data: {"DataSource"}, manager: {"RolloutManager", "RolloutBatch"},
              config: {"RolloutConfig", "WorkerConfig", "EngineSpec"},
              cluster: {"WorkerPool"}, worker: {"RolloutWorker"}, tool_cache: {"ToolCache"},
              groups: {"nonzero_variance", "Branching"}}
    for module, names in public.items():
        assert names <= set(module.__all__), module.__name__
        for name in names:
            assert getattr(module, name) is not None
    from palaestra.run.fleet import placement  # GPU plans belong to the run, not to the rollout

    assert {"plan_placement", "PlacementConfig", "PlacementPlan"} <= set(placement.__all__)


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
            "from palaestra.rollout.manager import RolloutManager\n"
            "from palaestra.rollout.play import run_episode\n"
            "from palaestra.rollout.data import DataSource\n"
            "from palaestra.rollout.tool_cache import ToolCache\n"
            "from palaestra.run.fleet.placement import plan_placement\n"
            "print(','.join(m for m in ('ray', 'torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""

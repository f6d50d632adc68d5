"""The seams' contracts in core (`palaestra.engine`, `palaestra.contracts`) fit the real classes,
and each has one import path."""

from __future__ import annotations

import os

import pytest

from palaestra.contracts import RolloutEnv, TrainerBackend, WeightSource
from palaestra.engine import Engine, Generation, SamplingParams


def test_the_engine_contract_has_one_home() -> None:
    """The engine contract lives in core (`palaestra.engine`) alone: the engines package names
    the same objects and no module re-exports them under another path."""
    import importlib.util

    import palaestra.engine as core_engine
    from palaestra import engines

    for name in ("Engine", "Generation", "SamplingParams", "EngineUnavailableError"):
        assert getattr(engines, name) is getattr(core_engine, name)
    assert importlib.util.find_spec("palaestra.engines.base") is None  # the old shim is gone


def test_engines_and_envs_satisfy_their_protocols() -> None:
    from palaestra.envs import make
    from palaestra.engines.clients.scripted import ScriptedEngine

    engine = ScriptedEngine([1, 2, 3])
    assert isinstance(engine, Engine)
    env = make("palaestra/Calculator-v0")
    try:
        assert isinstance(env, RolloutEnv)
        assert not isinstance(env, Engine) and not isinstance(engine, RolloutEnv)
    finally:
        env.close()


def test_the_torch_backend_is_a_trainer_backend(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from palaestra.tiny_model import build_model
    from palaestra.trainers.torch_backend.backend import TorchBackend
    from palaestra.trainers.torch_backend.config import TorchBackendConfig

    path = build_model(tmp_path / "micro", "micro")
    backend = TorchBackend(path, TorchBackendConfig(device="cpu"))
    assert isinstance(backend, TrainerBackend) and isinstance(backend, WeightSource)
    weights = backend.state_dict_for_engines()
    assert weights and all(isinstance(t, torch.Tensor) for t in weights.values())


def test_a_stand_in_without_the_methods_is_refused() -> None:
    class Half:
        async def areset(self, *, seed=None, options=None):  # no astep, no close
            return (), {}

    assert not isinstance(Half(), RolloutEnv)
    assert not isinstance(object(), TrainerBackend)

"""Fixtures of the rollout tests: the tiny tokenizer (built once), calculator task rows, worker
configs around the scripted engine, and one small Ray cluster with a pool of two rollout workers
shared by every Ray test (each test's manager reconfigures the pool instead of starting new
processes)."""

from __future__ import annotations

import asyncio
import functools
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """The micro Qwen3 model and its tokenizer (built locally, once per session)."""
    import torch

    from palaestra.tiny_model import build_model

    torch.set_num_threads(1)
    return str(build_model(tmp_path_factory.mktemp("rollout-model"), "micro"))


@pytest.fixture(scope="session")
def tokenizer_dir(model_dir) -> str:
    return model_dir


def calc_rows(n: int, env_id: str = "palaestra/Calculator-v0") -> list[dict]:
    return [
        {"env_id": env_id, "id": f"t{i}", "question": f"What is {i} + {3 * i + 1}?",
         "answer": str(4 * i + 1)}
        for i in range(n)
    ]


def worker_config(tokenizer_dir: str, *, p_correct: float = 0.5, latency_s: float = 0.0,
                  **kwargs):
    from palaestra.agents import AgentSpec
    from palaestra.rollout import EngineSpec, WorkerConfig
    from palaestra.rollout.engines.base import SamplingParams
    from palaestra.rollout.engines.scripted import ScriptedEngine
    from palaestra.rollout.testing import CalculatorPolicy

    factory = functools.partial(
        ScriptedEngine, CalculatorPolicy(tokenizer_dir, p_correct=p_correct), latency_s=latency_s
    )
    kwargs.setdefault("sampling", SamplingParams(max_new_tokens=64))
    kwargs.setdefault("seed_sampling", True)
    return WorkerConfig(engine=EngineSpec.from_factory(factory), agent=AgentSpec(tokenizer_dir),
                        **kwargs)


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_pool(ray_cluster, tokenizer_dir):
    """Two rollout workers as Ray actors (0.5 CPU each, so the 2-CPU cluster has room left)."""
    from palaestra.rollout import WorkerPool

    pool = WorkerPool(worker_config(tokenizer_dir), 2, cluster="ray", num_cpus=0.5)
    asyncio.run(pool.start())
    yield pool
    asyncio.run(pool.close())

"""Fixtures of the rollout tests: the micro model and its tokenizer (built once), and a pool of two
rollout workers on the session's Ray cluster (`ray_cluster`, tests/conftest.py) shared by every
Ray test (each test's manager reconfigures the pool instead of starting new processes). Helpers
live in `rollout_helpers`."""

from __future__ import annotations

import asyncio
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


@pytest.fixture(scope="session")
def ray_pool(ray_cluster, tokenizer_dir):
    """Two rollout workers as Ray actors (0.5 CPU each, so the 2-CPU cluster has room left),
    shared by every Ray test: each test's manager reconfigures them, as a training run's pool is
    reused for evaluation."""
    from rollout_helpers import worker_config

    from palaestra.rollout.cluster import WorkerPool

    pool = WorkerPool(worker_config(tokenizer_dir), 2, cluster="ray", num_cpus=0.5)
    asyncio.run(pool.start())
    yield pool
    asyncio.run(pool.close())

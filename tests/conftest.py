"""Fixtures shared by several test folders: one small local Ray cluster for the session (the
rollout workers' pool in tests/rollout and the run's engine actors and placement groups in
tests/run use the same one; Ray allows one per process)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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

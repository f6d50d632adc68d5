"""Rollout workers that Ray cannot place fail the pool within ``start_timeout_s``, with the
numbers, instead of a run that waits forever on actors ``PENDING_CREATION``.

The session's Ray cluster has 2 CPUs (tests/conftest.py); three workers of 1 CPU each cannot
all be placed whatever else holds CPUs, so at least one stays pending."""

from __future__ import annotations

import asyncio
import time

import pytest

from palaestra.errors import ConfigError

pytest.importorskip("ray")


def test_workers_left_pending_fail_the_pool_with_the_numbers(ray_cluster, tokenizer_dir) -> None:
    from rollout_helpers import worker_config

    from palaestra.rollout.cluster import WorkerPool

    pool = WorkerPool(worker_config(tokenizer_dir), 3, cluster="ray", num_cpus=1.0,
                      start_timeout_s=8.0)
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        asyncio.run(pool.start())
    assert time.monotonic() - start < 30
    message = str(err.value)
    assert "of 3 rollout workers (1 CPU each) did not start within 8 s" in message, message
    assert "PENDING_CREATION" in message, message
    assert "the cluster has 2 CPUs (1 node: 2)" in message, message
    assert "lower --rollout.num_workers" in message, message
    assert pool.handles == []  # every actor stopped: nothing left holding the cluster's CPUs
    deadline = time.monotonic() + 30  # the killed actors give their CPUs back
    while ray_cluster.available_resources().get("CPU", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray_cluster.available_resources().get("CPU", 0) >= 1

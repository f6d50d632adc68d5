"""`WorkerClient`: the same typed calls on an in-process worker and on a real Ray actor give the
same results (the scripted engine plays the calculator env for real in both)."""

from __future__ import annotations

import asyncio

import pytest
from rollout_helpers import calc_rows, worker_config

from palaestra.rollout.cluster import WorkerClient
from palaestra.rollout.groups import GroupTask, PauseReport
from palaestra.rollout.worker import RolloutWorker

pytestmark = pytest.mark.timeout(120)


def _tasks(prefix: str, n: int) -> list[GroupTask]:
    return [
        GroupTask(group_id=f"{prefix}{i}", env_id=row["env_id"], task=row, task_id=row["id"],
                  seeds=(10 * i, 10 * i + 1))
        for i, row in enumerate(calc_rows(n))
    ]


async def _collect(client: WorkerClient, tasks: list[GroupTask]) -> dict[str, tuple]:
    """Submit ``tasks`` and poll until every group is back; group id -> its samples' tokens and
    versions."""
    out: dict[str, tuple] = {}
    results = await client.exchange(tasks, 0.5)
    for _ in range(200):
        for r in results:
            assert r.worker == client.index
            out[r.group_id] = tuple(
                (tuple(s.token_ids_T), tuple(s.versions_T)) for t in r.trajectories
                for s in t.samples
            )
        if len(out) == len(tasks):
            return out
        results = await client.exchange((), 0.5)
    raise AssertionError(f"only {len(out)} of {len(tasks)} groups came back")


async def _script(client: WorkerClient) -> dict:
    assert await client.warmup() == client.index
    assert await client.ping() == client.index
    first = await _collect(client, _tasks("a", 3))
    report = await client.pause()
    assert isinstance(report, PauseReport)
    assert (report.parked_groups, report.parked_episodes) == (0, 0)  # nothing was running
    assert await client.resume() == 0
    await client.update_weights(1)
    second = await _collect(client, _tasks("b", 2))
    stats = await client.stats()
    await client.shutdown()
    return {"first": first, "second": second, "episodes": stats["episodes"],
            "worker": stats["worker"]}


async def test_local_and_ray_clients_run_the_same_calls(ray_cluster, tokenizer_dir):
    ray = ray_cluster
    config = worker_config(tokenizer_dir)
    local = await _script(WorkerClient(3, local=RolloutWorker(config, 3)))
    actor = ray.remote(num_cpus=0.25)(RolloutWorker).remote(config, 3)
    try:
        remote = await _script(WorkerClient(3, actor=actor))
    finally:
        ray.kill(actor)
    assert local == remote
    assert local["episodes"] == 10 and local["worker"] == 3
    # the sampled tokens' versions (-1: prompt and env tokens)
    assert {v for g in local["first"].values() for _, vs in g for v in vs} == {-1, 0}
    assert {v for g in local["second"].values() for _, vs in g for v in vs} == {-1, 1}


async def test_a_dead_actor_fails_the_awaited_call(ray_cluster, tokenizer_dir):
    ray = ray_cluster
    actor = ray.remote(num_cpus=0.25)(RolloutWorker).remote(worker_config(tokenizer_dir), 0)
    client = WorkerClient(0, actor=actor)
    assert await client.ping() == 0
    ray.kill(actor)
    with pytest.raises(ray.exceptions.RayActorError):
        await asyncio.wait_for(client.ping(), 30)


def test_a_client_wraps_exactly_one_worker(tokenizer_dir):
    worker = RolloutWorker(worker_config(tokenizer_dir))
    with pytest.raises(ValueError, match="either a local worker or a Ray actor"):
        WorkerClient(0)
    with pytest.raises(ValueError, match="either a local worker or a Ray actor"):
        WorkerClient(0, local=worker, actor=object())

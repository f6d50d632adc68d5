"""The manager's checkpoint holds its in-flight groups whole (async mode): a checkpoint taken while
episodes run changes none of their samples, in the run that goes on or in a new manager that
loads it; sync mode's exact batches have nothing in flight at a checkpoint. Real in-process
workers, the scripted engine playing the calculator env for real (two tool calls: 3 turns)."""

from __future__ import annotations

import asyncio
import json
import pickle

import pytest
from rollout_helpers import calc_rows

from palaestra.rollout.config import RolloutConfig
from palaestra.rollout.data import DataSource
from palaestra.rollout.manager import RolloutManager

pytestmark = pytest.mark.timeout(120)


def _wc(tokenizer_dir: str):
    import functools

    from palaestra.agents import AgentSpec
    from palaestra.rollout.config import EngineSpec, WorkerConfig
    from palaestra.engine import SamplingParams
    from palaestra.engines.clients.scripted import ScriptedEngine
    from palaestra.rollout.testing import CalculatorPolicy

    class LoggingEngine(ScriptedEngine):
        """The scripted engine, noting each request id (``<group>/<episode>:<request>``)."""

        async def generate(self, input_ids, sampling, *, request_id=None, session_id=None):
            self.log.append(request_id)
            return await super().generate(input_ids, sampling, request_id=request_id,
                                          session_id=session_id)

    LoggingEngine.log = []
    factory = functools.partial(LoggingEngine, CalculatorPolicy(tokenizer_dir, p_correct=0.5,
                                                                 n_calls=2), latency_s=0.02)
    return WorkerConfig(engine=EngineSpec.from_factory(factory), agent=AgentSpec(tokenizer_dir),
                        sampling=SamplingParams(max_new_tokens=64), seed_sampling=True,
                        env_kwargs={"palaestra/Calculator-v0": {"max_turns": 5}})


def _manager(tokenizer_dir: str, **cfg) -> RolloutManager:
    cfg = {"batch_size": 2, "group_size": 2, "num_workers": 1, "cluster": "local", **cfg}
    return RolloutManager(DataSource(calc_rows(60), seed=0, epochs=None), _wc(tokenizer_dir),
                          RolloutConfig(**cfg), seed=3, exact=cfg.get("mode", "sync") == "sync")


def _groups(batch) -> dict[str, tuple]:
    """Per task: its samples (tokens, mask, logprobs, versions, reward) and the env turns."""
    out: dict[str, list] = {}
    for t in batch.trajectories:
        s = t.samples[0]
        out.setdefault(t.task_id, []).append(
            (s.token_ids_T, s.loss_mask_T, s.logprobs_T, s.versions_T, s.reward, len(t.turns)))
    return {k: tuple(v) for k, v in out.items()}


async def _play(m: RolloutManager, first: int, steps: int) -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    for step in range(first, first + steps):
        out.update(_groups(await m.generate_batch(step)))
    return out


async def test_async_checkpoint_saves_inflight_groups_and_changes_no_sample(tokenizer_dir):
    async with _manager(tokenizer_dir, mode="async") as reference:
        await reference.generate_batch(0)
        expected = await _play(reference, 1, 3)

    async with _manager(tokenizer_dir, mode="async") as m:
        await m.generate_batch(0)
        log = m.pool.handles[0].local.engine.log
        while not any(r.endswith(":1") and r.startswith(("g3/", "g4/")) for r in log if r):
            await asyncio.sleep(0.002)  # until the prefetch of batch 1 is inside a second turn
        state = await m.checkpoint_state()
        entry = state["inflight"]
        live_after = await _play(m, 1, 3)  # the run that took the checkpoint goes on
    assert json.loads(json.dumps(state)) == state  # JSON-safe (backend_state.json)
    pickle.loads(pickle.dumps(state))
    assert entry["episodes"] > 0, entry | {"data": "..."}
    print(f"\nin-flight checkpoint: {entry['groups']} groups, {entry['episodes']} live episodes, "
          f"{entry['ready_groups']} ready groups, {entry['bytes']} bytes "
          f"({entry['bytes'] / max(entry['episodes'], 1):.0f} bytes per live episode)")
    for task, samples in live_after.items():
        if task in expected:
            assert samples == expected[task], task

    from palaestra.rollout.inflight import decode_inflight

    groups, ready, _ = decode_inflight(entry)
    saved = {g.task.task_id for g in groups} | {task.task_id for task, _ in ready}
    turns_done = sum(len(e.state.turns) for g in groups for e in g.live if e is not None)
    assert turns_done > 0  # some were past their first turn: they go on, not start over
    async with _manager(tokenizer_dir, mode="async") as resumed:
        resumed.load_state_dict(state)
        first = await resumed.generate_batch(1)
        got = {**_groups(first), **await _play(resumed, 2, 2)}
        log = list(resumed.pool.handles[0].local.engine.log)
    assert first.metrics["episodes/restored"] == entry["episodes"]
    assert first.metrics["ledger/unaccounted"] == 0
    assert saved <= set(got)
    for task in saved:
        assert got[task] == expected[task], task
    # the restored episodes sampled only their remaining turns: their first request in the new
    # manager is the one after their last completed turn
    turns = {t: [x[5] for x in v] for t, v in got.items()}
    for g in groups:
        for i, e in enumerate(g.live):
            if e is None:
                continue
            mine = sorted(int(r.rsplit(":", 1)[1]) for r in log
                          if r.rsplit(":", 1)[0] == f"{g.task.group_id}/{i}")
            assert mine == list(range(e.state.requests, turns[g.task.task_id][i])), (mine, e.state)
            assert e.state.requests == len(e.state.turns)
    assert not [r for r in log if r.split("/")[0] in {t.group_id for t, _ in ready}]


async def test_sync_exact_mode_has_nothing_in_flight_at_a_checkpoint(tokenizer_dir):
    async with _manager(tokenizer_dir, over_sampling=2.0) as m:
        for step in range(2):
            await m.generate_batch(step)
            await m.update_weights()
            state = await m.checkpoint_state()
            assert "inflight" not in state and not state["pending"]
            assert state == m.state_dict()


@pytest.mark.slow  # a Ray cluster's start
async def test_ray_and_local_clients_hand_over_inflight_groups(ray_cluster, tokenizer_dir):
    """`WorkerClient.inflight_state` of a Ray actor, `restore_inflight` into an in-process
    worker: the group finishes with the samples of an uninterrupted in-process run."""
    from palaestra.rollout.cluster import WorkerClient
    from palaestra.rollout.groups import GroupTask
    from palaestra.rollout.worker import RolloutWorker

    row = calc_rows(1)[0]
    task = GroupTask("g1", row["env_id"], row, row["id"], (5, 6, 7))

    async def finish(client: WorkerClient) -> tuple:
        for _ in range(400):
            results = await client.exchange((), 0.05)
            if results:
                return _groups(type("B", (), {"trajectories": results[0].trajectories})())
        raise AssertionError("the group never finished")

    reference = WorkerClient(0, local=RolloutWorker(_wc(tokenizer_dir)))
    try:
        await reference.exchange([task], 0)
        expected = await finish(reference)
    finally:
        await reference.shutdown()
    actor = ray_cluster.remote(num_cpus=0.25)(RolloutWorker).remote(_wc(tokenizer_dir), 0)
    remote = WorkerClient(0, actor=actor)
    try:
        await remote.exchange([task], 0.05)  # inside the first turns (0.02 s per request)
        await remote.close_gate()
        await remote.pause(abort=False)
        saved = await remote.inflight_state()
    finally:
        ray_cluster.kill(actor)
    live = [e for g in saved for e in g.live if e is not None]
    assert live, saved  # started episodes, saved at their last completed turn
    local = WorkerClient(1, local=RolloutWorker(_wc(tokenizer_dir), 1))
    try:
        assert await local.restore_inflight(saved) == len(live)
        assert await local.resume() == sum(d is None for g in saved for d in g.finished)
        assert await finish(local) == expected
    finally:
        await local.shutdown()


async def test_branching_groups_in_flight_restart_from_their_task(tokenizer_dir):
    """A tree's branches park inside its one task: the checkpoint holds its task (restarted on
    load, with the same seeds), never a half tree; taking it stalls nothing."""
    from palaestra.rollout.branching import BranchingConfig

    tree = BranchingConfig(turns=[1], width=2)
    async with _manager(tokenizer_dir, mode="async", branching=tree) as m:
        await m.generate_batch(0)
        log = m.pool.handles[0].local.engine.log
        while not any((r or "").startswith(("g3", "g4")) for r in log):
            await asyncio.sleep(0.002)
        state = await asyncio.wait_for(m.checkpoint_state(), 30)
        assert state["pending"] and all(p["branching"] for p in state["pending"])
        assert state["inflight"]["groups"] == 0
        await m.generate_batch(1)  # the run goes on
    async with _manager(tokenizer_dir, mode="async", branching=tree) as resumed:
        resumed.load_state_dict(state)
        batch = await resumed.generate_batch(1)
    assert {t.group_id for t in batch.trajectories} <= {p["group_id"] for p in state["pending"]}

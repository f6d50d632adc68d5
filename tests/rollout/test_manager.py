"""The manager with two Ray rollout workers: exact samples, failures, dynamic sampling, partial
rollout, async staleness, checkpoints. The scripted engine plays the calculator env for real."""

from __future__ import annotations

import asyncio
import random

import pytest
from rollout_helpers import calc_rows, worker_config

from palaestra.errors import RolloutError
from palaestra.rollout.config import RolloutConfig
from palaestra.rollout.data import DataSource
from palaestra.rollout.manager import RolloutManager
from palaestra.engines.clients.scripted import scripted_logprob
from palaestra.rollout.testing import FLAKY_ENTRY, CalculatorPolicy
from palaestra.types import StopReason

pytestmark = pytest.mark.timeout(300)


def manager(pool, tokenizer_dir, rows, *, wc=None, seed=0, exact=False, **cfg) -> RolloutManager:
    cfg.setdefault("num_workers", 2)
    return RolloutManager(DataSource(rows, seed=seed, epochs=None),
                          wc or worker_config(tokenizer_dir), RolloutConfig(**cfg), pool=pool,
                          exact=exact)


def check_ledger(metrics):
    assert metrics["ledger/unaccounted"] == 0
    assert metrics["ledger/drawn"] == sum(
        metrics[f"ledger/{k}"]
        for k in ("kept", "filtered", "failed", "stale_dropped", "queued", "in_flight", "ready")
    )


async def test_batch_of_64_groups_x4_is_token_exact(ray_pool, tokenizer_dir):
    async with manager(ray_pool, tokenizer_dir, calc_rows(200), batch_size=64, group_size=4,
                       max_concurrency=128) as m:
        batch = await m.generate_batch(0)
        stats = await m.worker_stats()
    assert len(batch.samples) == 256 and len(batch.group_ids) == 64
    assert all(w["episodes"] > 0 for w in stats)  # both workers played
    policy = CalculatorPolicy(tokenizer_dir)
    for traj, s in zip(batch.trajectories, batch.samples):
        assert traj.stop_reason is StopReason.TERMINATED and s.group_id == traj.group_id
        # the loss mask covers exactly the tokens the scripted policy sampled, turn by turn,
        # replayed here from the same prefix with the same per-request seed
        seed = int(traj.metrics["seed"])
        start = s.prompt_len
        for k, end in enumerate(s.turn_ends):
            mask = s.loss_mask_T[start:end]
            first = start + mask.index(1)
            assert all(mask[first - start:]) and not any(mask[: first - start])
            expected = policy(s.token_ids_T[:first], random.Random(seed + k))
            assert list(s.token_ids_T[first:end]) == expected
            start = end
        assert not any(s.loss_mask_T[s.turn_ends[-1]:])
        for i, m in enumerate(s.loss_mask_T):
            if m:  # logprobs are the engine's, for that token in that context
                assert s.logprobs_T[i] == scripted_logprob(s.token_ids_T[i - 1], s.token_ids_T[i])
            else:
                assert s.logprobs_T[i] == 0.0 and s.versions_T[i] == -1
    check_ledger(batch.metrics)
    assert batch.metrics["groups/kept"] == 64 and batch.metrics["episodes/failed"] == 0


async def test_flaky_env_failures_are_recorded_and_counted(ray_pool, tokenizer_dir):
    rows = calc_rows(300, env_id=FLAKY_ENTRY)
    wc = worker_config(tokenizer_dir, env_kwargs={FLAKY_ENTRY: {"fail_rate": 0.1}})
    async with manager(ray_pool, tokenizer_dir, rows, wc=wc, batch_size=32, group_size=4,
                       min_group_size=2) as m:
        batch = await m.generate_batch(0)
    metrics = batch.metrics
    assert len(batch.group_ids) == 32
    assert batch.failed and all(t.error and "flaky env failed" in t.error for t in batch.failed)
    assert all(t.stop_reason is StopReason.ERROR for t in batch.failed)
    assert not any(t.failed for t in batch.trajectories)  # failures never reach training
    finished = metrics["episodes/finished"]
    groups_done = metrics["groups/kept"] + metrics.get("groups/failed", 0) + metrics.get(
        "groups/filtered", 0)
    assert finished == 4 * groups_done  # every episode of every finished group is accounted
    assert metrics["episodes/failed"] == len(batch.failed)
    assert sum(v for k, v in metrics.items() if k.startswith("stop_reason/")) == finished
    assert metrics["stop_reason/error"] == len(batch.failed)
    assert 0.05 < metrics["episodes/failure_rate"] < 0.4  # ~10% per step, two steps an episode
    check_ledger(metrics)


async def test_failure_rate_threshold_raises(ray_pool, tokenizer_dir):
    rows = calc_rows(100, env_id=FLAKY_ENTRY)
    wc = worker_config(tokenizer_dir, env_kwargs={FLAKY_ENTRY: {"fail_rate": 0.9}})
    async with manager(ray_pool, tokenizer_dir, rows, wc=wc, batch_size=8, group_size=4,
                       max_failure_rate=0.2) as m:
        with pytest.raises(RolloutError, match="max_failure_rate") as err:
            await m.generate_batch(0)
    assert "flaky env failed" in str(err.value)


async def test_dynamic_sampling_fills_batch_with_varied_groups(ray_pool, tokenizer_dir):
    async with manager(ray_pool, tokenizer_dir, calc_rows(300), batch_size=32, group_size=4,
                       filters=("nonzero_variance",), over_sampling=1.5) as m:
        batch = await m.generate_batch(0)
        second = await m.generate_batch(1)
    for b in (batch, second):
        assert len(b.group_ids) == 32
        by_group: dict[str, set[float]] = {}
        for s in b.samples:
            by_group.setdefault(s.group_id, set()).add(s.reward)
        assert all(len(rewards) > 1 for rewards in by_group.values())
        check_ledger(b.metrics)
    filtered = batch.metrics["groups/filtered/nonzero_variance"] + second.metrics.get(
        "groups/filtered/nonzero_variance", 0)
    assert filtered > 0  # ~1/8 of groups are all-right or all-wrong at p=0.5


async def test_dynamic_sampling_gives_up_at_the_draw_cap(ray_pool, tokenizer_dir):
    wc = worker_config(tokenizer_dir, p_correct=0.0)  # every group is all-wrong
    async with manager(ray_pool, tokenizer_dir, calc_rows(100), wc=wc, batch_size=4,
                       group_size=2, filters=("nonzero_variance",), max_draw_factor=3) as m:
        with pytest.raises(RolloutError, match="no group could be kept"):
            await m.generate_batch(0)
        assert m._step.counters["groups/drawn"] == 12  # the cap: 4 x 3 draws, no more


class StallingEngine:
    """The scripted calculator engine, except that the first request of every episode of the
    groups drawn after the first ``fast_groups`` waits until it is aborted, then returns half
    of its tokens (finish reason ``abort``); the session's next request returns the rest. The
    park point is thus fixed, not timing: what partial rollout does with it can be checked."""

    def __init__(self, tokenizer_dir: str, fast_groups: int) -> None:
        from palaestra.engines.clients.scripted import ScriptedEngine

        self.inner = ScriptedEngine(CalculatorPolicy(tokenizer_dir))
        self.fast_groups = fast_groups
        self._waiting: dict[str, asyncio.Event] = {}
        self._rest: dict[str, tuple[int, ...]] = {}
        self._stalled: set[str] = set()

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    async def generate(self, input_ids, sampling, *, request_id=None, session_id=None):
        from palaestra.engine import Generation

        version = self.inner.weight_version
        if session_id in self._rest:  # the continuation of an aborted request
            rest = self._rest.pop(session_id)
            prev, logprobs = input_ids[-1], []
            for t in rest:
                logprobs.append(scripted_logprob(prev, t))
                prev = t
            return Generation(rest, tuple(logprobs), "stop", weight_version=version)
        full = await self.inner.generate(input_ids, sampling, request_id=request_id)
        group = int(str(session_id).split("/")[0].removeprefix("g"))
        if group <= self.fast_groups or session_id in self._stalled:
            return full
        self._stalled.add(session_id)
        event = self._waiting[request_id] = asyncio.Event()
        await event.wait()
        del self._waiting[request_id]
        half = len(full.token_ids) // 2
        self._rest[session_id] = full.token_ids[half:]
        return Generation(full.token_ids[:half], full.logprobs[:half], "abort",
                          weight_version=version)

    async def abort(self, request_ids=None):
        for rid in list(self._waiting) if request_ids is None else request_ids:
            if rid in self._waiting:
                self._waiting[rid].set()

    async def pause(self):
        await self.abort()

    async def resume(self):
        pass

    async def update_weights(self, state_dict=None, *, path=None, version=None):
        await self.inner.update_weights(state_dict, path=path, version=version)

    async def flush_cache(self):
        pass

    async def health(self):
        return True

    async def close(self):
        await self.abort()


async def test_partial_rollout_resumes_parked_groups_from_their_tokens(tokenizer_dir):
    engine = StallingEngine(tokenizer_dir, fast_groups=4)
    m = RolloutManager(DataSource(calc_rows(50), epochs=None), worker_config(tokenizer_dir),
                       RolloutConfig(batch_size=4, group_size=2, over_sampling=3.0,
                                     max_staleness=1, num_workers=1),
                       cluster="local", engine=engine)
    async with m:
        first = await m.generate_batch(0)  # sync mode: the over-sampled groups are parked
        assert first.group_ids == ["g1", "g2", "g3", "g4"]
        assert first.metrics["groups/parked"] == first.metrics["groups/in_flight"] == 8
        assert first.metrics["episodes/parked"] == 16
        await m.update_weights()  # v1: parked groups go on from their tokens
        second = await m.generate_batch(1)
    assert second.group_ids == ["g5", "g6", "g7", "g8"]  # the oldest parked groups first
    assert second.metrics["episodes/resumed"] == 16
    policy = CalculatorPolicy(tokenizer_dir)
    for s in second.samples:  # each sampled partly by v0 and partly by v1
        assert {v for v, k in zip(s.versions_T, s.loss_mask_T) if k} == {0, 1}
        assert s.stop_reason is StopReason.TERMINATED
        # and its tokens are what one uninterrupted generation would have given
        assert all(s.logprobs_T[i] == scripted_logprob(s.token_ids_T[i - 1], s.token_ids_T[i])
                   for i in range(1, s.num_tokens) if s.loss_mask_T[i])
        turn = [i for i in range(s.prompt_len, s.turn_ends[0]) if s.loss_mask_T[i]]
        assert [s.token_ids_T[i] for i in turn] == policy(s.token_ids_T[: turn[0]],
                                                         random.Random(0))
    assert max(second.version - s.min_version for s in second.samples) <= 1
    check_ledger(second.metrics)


def _batches(pool, tokenizer_dir, *, exact, steps=3, **cfg):
    """Token ids of ``steps`` batches (filter any_success: some groups are dropped and redrawn)."""
    async def play():
        out = []
        m = manager(pool, tokenizer_dir, calc_rows(200), batch_size=4, group_size=2,
                    filters=("any_success",), over_sampling=3.0, exact=exact, **cfg)
        async with m:
            for step in range(steps):
                batch = await m.generate_batch(step)
                if exact:  # nothing was drawn ahead: nothing is left in flight
                    assert batch.metrics["groups/in_flight"] == 0
                    assert batch.metrics.get("groups/ready_carried", 0) == 0
                out.append([s.token_ids_T for s in batch.samples])
                await m.update_weights()
        return out
    return play()


async def test_exact_batches_do_not_depend_on_timing_or_workers(ray_pool, tokenizer_dir):
    """Two Ray workers with a slow engine vs one in-process worker with an instant one: the
    episodes finish in other orders, the batches are the same, sample for sample."""
    from palaestra.rollout.cluster import WorkerPool

    slow = await _batches(ray_pool, tokenizer_dir, exact=True,
                          wc=worker_config(tokenizer_dir, latency_s=0.02))
    local = WorkerPool(worker_config(tokenizer_dir), 1, cluster="local")
    try:
        fast = await _batches(local, tokenizer_dir, exact=True, num_workers=1)
    finally:
        await local.close()
    assert slow == fast


def test_exact_batches_need_sync_mode(tokenizer_dir):
    from palaestra.errors import ConfigError

    with pytest.raises(ConfigError, match="exact batches need mode='sync'"):
        RolloutManager(DataSource(calc_rows(4)), worker_config(tokenizer_dir),
                       RolloutConfig(mode="async"), cluster="local", exact=True)


@pytest.mark.parametrize("bound", [0, 1])
async def test_async_mode_respects_the_staleness_bound(ray_pool, tokenizer_dir, bound):
    wc = worker_config(tokenizer_dir, latency_s=0.05)
    stale_events = 0
    async with manager(ray_pool, tokenizer_dir, calc_rows(400), wc=wc, batch_size=8,
                       group_size=2, mode="async", max_staleness=bound,
                       over_sampling=2.0) as m:
        for step in range(4):
            batch = await m.generate_batch(step)
            assert batch.version == m.version == step
            lag = [batch.version - s.min_version for s in batch.samples]
            assert max(lag) <= bound, (step, lag)
            stale_events += batch.metrics.get("groups/stale_requeued", 0)
            await asyncio.sleep(0.3)  # "training": batch k+1 is being generated meanwhile
            await m.update_weights()
            check_ledger(batch.metrics)
    if bound == 0:
        assert stale_events > 0  # the prefetched groups were generated one version behind


async def test_checkpoint_restores_position_and_pending_tasks(ray_pool, tokenizer_dir):
    rows = calc_rows(100)
    async with manager(ray_pool, tokenizer_dir, rows, batch_size=4, group_size=2,
                       over_sampling=2.0) as m:
        await m.generate_batch(0)
        state = m.state_dict()
        pending = {p["task_id"] for p in state["pending"]}
        assert pending  # the over-sampled groups in flight when the batch was handed off
    async with manager(ray_pool, tokenizer_dir, rows, batch_size=len(pending) + 4,
                       group_size=2) as resumed:
        resumed.load_state_dict(state)
        batch = await resumed.generate_batch(1)
    got = {t.task_id for t in batch.trajectories}
    assert pending <= got
    check_ledger(batch.metrics)

"""Record/replay of tool results: a recorded run replays identically, replay really answers from
the file, and a call that was never recorded fails the episode visibly. Also the worker behaviour
that recording and then replaying on one pool depends on: a long-poll left over from the first
run does not take the second run's results."""

from __future__ import annotations

import asyncio
import json

import pytest
from rollout_helpers import calc_rows, worker_config

from palaestra.agents import make_agent
from palaestra.envs import make
from palaestra.errors import ConfigError
from palaestra.rollout.config import RolloutConfig
from palaestra.rollout.data import DataSource
from palaestra.rollout.manager import RolloutManager
from palaestra.rollout.play import run_episode
from palaestra.rollout.tool_cache import ToolCache
from palaestra.engine import SamplingParams
from palaestra.engines.clients.scripted import ScriptedEngine
from palaestra.rollout.testing import CalculatorPolicy
from palaestra.rollout.groups import GroupTask
from palaestra.rollout.worker import RolloutWorker
from palaestra.types import StopReason

TASK = {"id": "c1", "question": "What is 5 * 9?", "answer": "45"}


def essence(traj):
    """Everything that must replay identically (timings excluded)."""
    return (traj.group_id, traj.task_id, traj.reward, traj.stop_reason,
            [m.to_dict() for m in traj.messages],
            [(s.token_ids_T, s.loss_mask_T, s.logprobs_T) for s in traj.samples])


async def run(pool, tokenizer_dir, mode, path):
    wc = worker_config(tokenizer_dir, tool_cache=(str(path), mode))
    cfg = RolloutConfig(batch_size=8, group_size=2, num_workers=2)
    async with RolloutManager(DataSource(calc_rows(40), seed=5), wc, cfg, pool=pool) as m:
        batch = await m.generate_batch(0)
        stats = await m.worker_stats()
    return batch, [w["tool_cache"] for w in stats]


async def test_record_then_replay_through_ray_workers(ray_pool, tokenizer_dir, tmp_path):
    path = tmp_path / "tools.jsonl"
    recorded, _ = await run(ray_pool, tokenizer_dir, "record", path)
    calls = sum(t.metrics["tool_calls"] for t in recorded.trajectories)
    lines = path.read_text().splitlines()
    assert calls > 0 and len(lines) >= calls  # both workers appended to one file
    assert all(json.loads(line)["env_id"] == "palaestra/Calculator-v0" for line in lines)
    replayed, rep_stats = await run(ray_pool, tokenizer_dir, "replay", path)
    assert sum(s["hits"] for s in rep_stats) == calls and sum(s["misses"] for s in rep_stats) == 0
    assert sum(s["recorded"] for s in rep_stats) == 0
    key = lambda t: (t.group_id, t.metrics["seed"])
    a = [essence(t) for t in sorted(recorded.trajectories, key=key)]
    b = [essence(t) for t in sorted(replayed.trajectories, key=key)]
    assert a == b


async def test_an_abandoned_poll_does_not_take_the_next_runs_results(tokenizer_dir, tmp_path):
    # Ray goes on running an exchange whose caller has gone (a closed manager cancels only its
    # own await); here that poll is a task nobody awaits. The linger keeps it waiting while the
    # next run's group finishes, so without the run check it would return that group to nobody.
    wc = worker_config(tokenizer_dir, linger_s=0.2)
    worker = RolloutWorker(wc, 0)
    stale = asyncio.ensure_future(worker.exchange([], 30.0))
    await asyncio.sleep(0.01)
    await worker.configure(worker_config(tokenizer_dir, linger_s=0.2,
                                         tool_cache=(str(tmp_path / "t.jsonl"), "record")))
    row = calc_rows(1)[0]
    group = GroupTask("g1", row["env_id"], row, row["id"], (1, 2))
    fresh = await worker.exchange([group], 30.0)
    assert await asyncio.wait_for(stale, 5) == []
    assert [r.group_id for r in fresh] == ["g1"] and len(fresh[0].trajectories) == 2
    await worker.shutdown()


async def test_replay_answers_from_the_file(tokenizer_dir, tmp_path):
    path = tmp_path / "tools.jsonl"
    engine = ScriptedEngine(CalculatorPolicy(tokenizer_dir, p_correct=1.0))
    env = ToolCache(path, "record").attach(make("palaestra/Calculator-v0"), "calc")
    traj = await run_episode(env, make_agent(tokenizer_dir), engine, SamplingParams(), task=TASK)
    assert traj.turns[0].observation[0].content == "45"
    env.unwrapped.tool_runner.cache.close()
    entry = json.loads(path.read_text())
    assert entry["task_id"] == "c1" and entry["name"] == "calculator"
    path.write_text(json.dumps({**entry, "content": "46"}) + "\n")  # tamper with the recording
    replay = ToolCache(path, "replay")
    env = replay.attach(make("palaestra/Calculator-v0"), "calc")
    traj = await run_episode(env, make_agent(tokenizer_dir), engine, SamplingParams(), task=TASK)
    assert traj.turns[0].observation[0].content == "46" and replay.hits == 1
    # a task that was never recorded: replay fails the episode with a clear error
    other = {"id": "c2", "question": "What is 2 * 3?", "answer": "6"}
    traj = await run_episode(env, make_agent(tokenizer_dir), engine, SamplingParams(), task=other)
    assert traj.stop_reason is StopReason.ERROR and "ToolCacheMissError" in traj.error
    # auto mode records the miss and replays it the next time
    auto = ToolCache(path, "auto")
    env = auto.attach(make("palaestra/Calculator-v0"), "calc")
    await run_episode(env, make_agent(tokenizer_dir), engine, SamplingParams(), task=other)
    await run_episode(env, make_agent(tokenizer_dir), engine, SamplingParams(), task=other)
    assert (auto.misses, auto.recorded, auto.hits) == (1, 1, 1)
    auto.close()


def test_cache_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="record it first"):
        ToolCache(tmp_path / "none.jsonl", "replay")
    with pytest.raises(ConfigError, match="mode"):
        ToolCache(tmp_path / "x.jsonl", "write")

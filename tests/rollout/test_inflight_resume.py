"""In-flight episodes survive a crash: a worker process parks its episodes mid-group, writes them
to a checkpoint file and is killed with SIGKILL; a new worker restores them and plays them on
from their last completed turn. With seeded sampling the samples equal an uninterrupted run's,
token for token (ids, loss mask, logprobs, versions, rewards)."""

from __future__ import annotations

import asyncio
import functools
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from palaestra.engine import SamplingParams

TASK = {"id": "t3", "question": "What is 12 + 30 * 2?", "answer": "72"}
SEEDS = (11, 12, 13, 14)

# the crashing side: play the group, park it mid-way, checkpoint it, die by SIGKILL
CRASH = r'''
import asyncio, os, pickle, signal, sys
sys.path.insert(0, sys.argv[3])
from test_inflight_resume import worker_config, group_task
from palaestra.rollout.worker import RolloutWorker

async def main():
    worker = RolloutWorker(worker_config(sys.argv[1]))
    worker.submit([group_task()])
    while worker.engine.requests < 7:  # every episode past turn 0, some inside turn 1
        await asyncio.sleep(0.005)
    await worker.pause()
    saved = await worker.inflight_state()
    with open(sys.argv[2] + ".tmp", "wb") as f:
        pickle.dump(saved, f)
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
'''


def worker_config(tokenizer_dir: str) -> Any:
    from palaestra.agents import AgentSpec
    from palaestra.rollout.config import EngineSpec, WorkerConfig
    from palaestra.engines.clients.scripted import ScriptedEngine
    from palaestra.rollout.testing import CalculatorPolicy

    factory = functools.partial(ScriptedEngine, CalculatorPolicy(tokenizer_dir, p_correct=0.5,
                                                                 n_calls=2), latency_s=0.05)
    return WorkerConfig(engine=EngineSpec.from_factory(factory), agent=AgentSpec(tokenizer_dir),
                        sampling=SamplingParams(max_new_tokens=64), seed_sampling=True,
                        env_kwargs={"palaestra/Calculator-v0": {"max_turns": 5}})


def group_task() -> Any:
    from palaestra.rollout.groups import GroupTask

    return GroupTask("g1", "palaestra/Calculator-v0", TASK, "t3", SEEDS)


def _key(t: Any) -> tuple:
    s = t.samples[0]
    return (s.token_ids_T, s.loss_mask_T, s.logprobs_T, s.versions_T, s.reward, s.turn_rewards,
            s.turn_ends, s.stop_reason, t.reward, len(t.turns))


async def _finish(worker: Any) -> Any:
    for _ in range(400):
        results = await worker.collect(0.05)
        if results:
            return results[0].trajectories
    raise AssertionError("the group never finished")


async def test_episodes_resume_after_kill9_with_the_uninterrupted_samples(
        tokenizer_dir, tmp_path: Path) -> None:
    from palaestra.rollout.worker import RolloutWorker

    reference = RolloutWorker(worker_config(tokenizer_dir))
    try:
        reference.submit([group_task()])
        expected = await _finish(reference)
    finally:
        await reference.shutdown()
    assert all(len(t.turns) == 3 and not t.failed for t in expected)

    checkpoint = tmp_path / "inflight.pkl"
    here = str(Path(__file__).parent)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CRASH, tokenizer_dir, str(checkpoint), here,
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    saved = pickle.loads(checkpoint.read_bytes())

    live = [e for g in saved for e in g.live if e is not None]
    assert live, "nothing was in flight at the checkpoint"
    assert any(e.state.turns for e in live)  # past their first turn: resumed, not restarted

    resumed = RolloutWorker(worker_config(tokenizer_dir))
    try:
        assert await resumed.restore_inflight(saved) == len(live)
        await resumed.resume()
        got = await _finish(resumed)
        requests = resumed.engine.requests
    finally:
        await resumed.shutdown()
    assert [_key(t) for t in got] == [_key(t) for t in expected]
    # the resumed worker sampled only what was left: not the turns done before the kill
    assert requests == 12 - sum(len(e.state.turns) for e in live)


async def test_a_cut_turn_is_rolled_back_to_the_last_completed_turn(tokenizer_dir) -> None:
    from palaestra.rollout.inflight import restore_episode, save_episode
    from palaestra.rollout.worker import RolloutWorker

    worker = RolloutWorker(worker_config(tokenizer_dir))
    try:
        worker.submit([group_task()])
        while worker.engine.requests < 6:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.02)  # inside the latency of the turn-1 requests
        await worker.pause()
        (group,) = worker._groups.values()
        cut = [e for e in group.episodes if e.agent is not None and e.agent._resumable]
        assert cut, "no generation was cut by the pause"
        ep = cut[0]
        saved = save_episode(ep.env, ep.agent, ep.state)
        assert saved.rolled_back_tokens > 0 or ep.state.partial_tokens == 0
        assert len(saved.turn_ends) == len(saved.state.turns) == len(ep.state.turns)
        assert len(saved.messages) == len(ep.agent.messages) - 1  # the cut assistant message
        assert saved.ids == tuple(ep.agent.transcript.ids[:len(saved.ids)])
        assert saved.mask[-1] == 0  # ends with the observation of the last completed turn
        assert saved.state.requests == len(saved.state.turns)
        fresh_env = worker._acquire("palaestra/Calculator-v0", fresh=True)
        fresh_agent = worker._make_agent()
        state = restore_episode(saved, fresh_env, fresh_agent)
        assert fresh_agent.input_ids == list(saved.ids)
        assert fresh_env.history == ep.env.history and fresh_env.turn == ep.env.turn
        assert state.turns == ep.state.turns
    finally:
        await worker.shutdown()

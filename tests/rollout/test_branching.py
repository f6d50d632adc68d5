"""Branching groups: leaves share their prefix's exact tokens and fork into independent envs,
agents and sampling streams; the embedded engine computes the shared prefix once (its prefix
cache counters); the config refuses trees a group cannot hold."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import pytest

from palaestra.errors import ConfigError
from palaestra.rollout.groups import Branching
from palaestra.rollout.branching import (
    TreeHooks,
    TreeRequest,
    expected_generated_ratio,
    play_branching_group,
)
from palaestra.engine import SamplingParams

TASK = {"id": "t7", "question": "What is 17 + 25?", "answer": "42"}


def _worker_config(tokenizer_dir: str, n_calls: int = 2) -> Any:
    from palaestra.agents import AgentSpec
    from palaestra.rollout.config import EngineSpec, WorkerConfig
    from palaestra.engines.clients.scripted import ScriptedEngine
    from palaestra.rollout.testing import CalculatorPolicy

    factory = functools.partial(ScriptedEngine, CalculatorPolicy(tokenizer_dir, p_correct=0.5,
                                                                 n_calls=n_calls))
    return WorkerConfig(engine=EngineSpec.from_factory(factory), agent=AgentSpec(tokenizer_dir),
                        sampling=SamplingParams(max_new_tokens=64), seed_sampling=True,
                        env_kwargs={"palaestra/Calculator-v0": {"max_turns": 5}})


async def _play_group(tokenizer_dir: str, branching: Branching | None, n: int = 8) -> Any:
    from palaestra.rollout.groups import GroupTask
    from palaestra.rollout.worker import RolloutWorker

    worker = RolloutWorker(_worker_config(tokenizer_dir))
    task = GroupTask("g1", "palaestra/Calculator-v0", TASK, "t7",
                     tuple(1000 + i for i in range(n)), branching=branching)
    try:
        results = await worker.exchange([task], wait_s=30.0)
        assert len(results) == 1
        return results[0].trajectories, worker.engine
    finally:
        await worker.shutdown()


async def test_worker_plays_a_tree_whose_leaves_share_exact_prefixes(tokenizer_dir) -> None:
    leaves, engine = await _play_group(tokenizer_dir, Branching((1, 2), 2))
    assert len(leaves) == 8 and all(not t.failed and len(t.samples) == 1 for t in leaves)
    assert all(len(t.turns) == 3 for t in leaves)  # call, call, answer
    # 2 roots x (1 + 2 + 4) generations instead of 8 x 3
    assert engine.requests == 14
    samples = [t.samples[0] for t in leaves]
    for i, s in enumerate(samples):
        assert s.metrics["tree/leaf"] == i
        root, mid = i // 4 * 4, i // 2 * 2
        for j, cut in ((root, 0), (mid, 1)):  # same node of turn `cut`: the same exact tokens
            end = s.turn_ends[cut]
            other = samples[j]
            assert other.token_ids_T[:end] == s.token_ids_T[:end]
            assert other.logprobs_T[:end] == s.logprobs_T[:end]
            assert other.versions_T[:end] == s.versions_T[:end]
            assert other.metrics[f"tree/node/{cut}"] == s.metrics[f"tree/node/{cut}"]
    nodes = [[s.metrics[f"tree/node/{k}"] for s in samples] for k in range(3)]
    assert [len(set(n)) for n in nodes] == [2, 4, 8]
    # every leaf's env stepped on its own: its own answer in its own history
    rewards = [t.reward for t in leaves]
    assert len(set(rewards)) == 2, rewards  # right and wrong answers (seeded per branch)
    finals = {t.turns[-1].action.content for t in leaves}
    assert len(finals) == 2


async def test_branching_is_reproducible_and_independent_groups_unchanged(tokenizer_dir) -> None:
    a, _ = await _play_group(tokenizer_dir, Branching((1, 2), 2))
    b, _ = await _play_group(tokenizer_dir, Branching((1, 2), 2))
    assert [t.samples[0] for t in a] == [t.samples[0] for t in b]
    flat, engine = await _play_group(tokenizer_dir, None)
    assert engine.requests == 24
    roots = [t.samples[0] for t in a[::4]]
    # a root samples with its first leaf's seed, as that leaf's independent episode does, so
    # its first turn equals it token for token
    for root, leaf in zip(roots, [flat[0].samples[0], flat[4].samples[0]]):
        end = root.turn_ends[0]
        assert root.token_ids_T[:end] == leaf.token_ids_T[:end]


async def test_episode_that_ends_before_the_branch_point_stands_for_its_leaves(
        tokenizer_dir) -> None:
    # one tool call then the answer: 2 turns, so the fork before turn 2 never happens
    leaves_1call, engine_1 = await _play_group_calls(tokenizer_dir, Branching((1, 2), 2))
    assert len(leaves_1call) == 4
    assert engine_1.requests == 1 + 2
    copies = [t.samples[0].metrics.get("tree/copy", 0.0) for t in leaves_1call]
    assert copies == [0.0, 1.0, 0.0, 1.0]
    assert leaves_1call[0].samples[0].token_ids_T == leaves_1call[1].samples[0].token_ids_T


async def _play_group_calls(tokenizer_dir: str, branching: Branching) -> Any:
    from palaestra.rollout.groups import GroupTask
    from palaestra.rollout.worker import RolloutWorker

    worker = RolloutWorker(_worker_config(tokenizer_dir, n_calls=1))
    task = GroupTask("g2", "palaestra/Calculator-v0", TASK, "t7", (1, 2, 3, 4),
                     branching=branching)
    try:
        (result,) = await worker.exchange([task], wait_s=30.0)
        return result.trajectories, worker.engine
    finally:
        await worker.shutdown()


# ---------------------------------------------------------------------- the embedded engine
def _echo_env() -> Any:
    from palaestra.envs.base import MultiTurnEnv, StepResult
    from palaestra.types import Message

    class Echo(MultiTurnEnv):
        """Answers every turn with the turn number; reward 1 when the last reply was short."""

        step_in_thread = False

        def initial_messages(self, task: Any) -> list[Message]:
            return [Message(role="user", content=f"Say something about {task['topic']}.")]

        def respond(self, action: Message) -> StepResult:
            done = self.turn >= self.max_turns
            reward = float(done and len(action.content) % 2 == 0)
            return StepResult([Message(role="user", content=f"turn {self.turn} ok")], reward)

    return Echo(max_turns=3, dataset=[{"topic": "cats"}])


async def _play_local(engine: Any, model_dir: str, branching: Branching) -> Any:
    from palaestra.agents import AgentSpec

    spec = AgentSpec(model_dir)
    envs: list[Any] = []

    def acquire() -> Any:
        env = _echo_env()
        envs.append(env)
        return env

    hooks = TreeHooks(acquire_env=acquire, release_env=lambda e: None,
                      acquire_agent=spec.build, release_agent=lambda a: None,
                      wait_gate=lambda: asyncio.sleep(0))
    # a random micro model rarely closes its turn: stop on a third of the vocabulary instead
    # (turns of ~3 tokens that end with "stop", so every episode plays its 3 turns)
    stops = tuple(range(0, len(spec.build().tokenizer), 3))
    request = TreeRequest("g", "echo", {"topic": "cats"}, tuple(range(8)), branching,
                          SamplingParams(max_new_tokens=12, temperature=1.0,
                                         stop_token_ids=stops), seed_sampling=True)
    before = dict(engine.stats)
    leaves = await play_branching_group(request, engine, hooks)
    after = engine.stats
    return leaves, {k: after[k] - before[k] for k in after}


@pytest.mark.slow
async def test_embedded_engine_reuses_the_shared_prefix(model_dir) -> None:
    from palaestra.engines.local.local import LocalEngine

    engine = LocalEngine(model_dir, max_running=8, use_thread=False)
    try:
        flat, flat_c = await _play_local(engine, model_dir, Branching((), 1))
        await engine.flush_cache()
        tree, tree_c = await _play_local(engine, model_dir, Branching((1, 2), 2))
    finally:
        await engine.close()
    assert all(not t.failed and len(t.turns) == 3 for t in [*flat, *tree])
    # 8 x 3 sampled turns against 2 x (1 + 2 + 4)
    assert tree_c["generated_tokens"] < flat_c["generated_tokens"] * 14 / 24 + 8
    assert tree_c["prefill_tokens"] < flat_c["prefill_tokens"]
    # each child's first request found its parent's tokens in the cache
    assert tree_c["cached_tokens"] > 0
    s = [t.samples[0] for t in tree]
    assert s[0].token_ids_T[:s[0].turn_ends[1]] == s[1].token_ids_T[:s[1].turn_ends[1]]


def test_config_and_spec_errors() -> None:
    from palaestra.rollout.config import RolloutConfig

    with pytest.raises(ConfigError, match="multiple of 4"):
        RolloutConfig(group_size=6, branching={"turns": [1, 2], "width": 2})
    with pytest.raises(ConfigError, match="increasing"):
        RolloutConfig(group_size=8, branching={"turns": [2, 1], "width": 2})
    with pytest.raises(ConfigError, match="width"):
        RolloutConfig(group_size=8, branching={"turns": [1], "width": 1})
    assert Branching((1, 2), 2).roots(8) == 2
    assert expected_generated_ratio(Branching((1, 2), 2), 3) == pytest.approx(24 / 14)

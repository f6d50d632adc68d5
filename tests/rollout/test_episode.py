"""`run_episode` with the real calculator env, the real agent and the scripted engine: exact
tokens, and every failure mode recorded on the trajectory instead of raised."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from palaestra.agents import make_agent
from palaestra.envs import make
from palaestra.rollout.episode import EpisodeState
from palaestra.rollout.play import run_episode
from palaestra.engine import SamplingParams
from palaestra.engines.clients.scripted import ScriptedEngine, scripted_logprob
from palaestra.rollout.testing import FLAKY_ENTRY, CalculatorPolicy
from palaestra.types import StopReason

TASK = {"id": "t1", "question": "What is 12 + 30?", "answer": "42"}


class Recording:
    """Wraps an engine and keeps every generation it returned (to compare with the sample)."""

    def __init__(self, engine):
        self.engine = engine
        self.calls = []

    @property
    def weight_version(self):
        return self.engine.weight_version

    async def generate(self, input_ids, sampling, **kw):
        gen = await self.engine.generate(input_ids, sampling, **kw)
        self.calls.append((list(input_ids), sampling, gen))
        return gen


@pytest.fixture
def policy(tokenizer_dir):
    return CalculatorPolicy(tokenizer_dir, p_correct=1.0)


@pytest.fixture
def agent(tokenizer_dir):
    return make_agent(tokenizer_dir, "qwen", max_context=1024)


async def test_sample_is_token_exact(policy, agent):
    engine = Recording(ScriptedEngine(policy, version=3))
    env = make("palaestra/Calculator-v0")
    traj = await run_episode(env, agent, engine, SamplingParams(max_new_tokens=64), task=TASK,
                             session_id="s")
    assert traj.stop_reason is StopReason.TERMINATED and traj.error is None
    assert traj.reward == 1.0 and len(traj.turns) == 2 and traj.metrics["tool_calls"] == 1
    (sample,) = traj.samples
    sampled = [i for i, m in enumerate(sample.loss_mask_T) if m]
    # the loss mask covers exactly the tokens the engine returned, in order, nothing else
    returned = [t for _, _, g in engine.calls for t in g.token_ids]
    assert [sample.token_ids_T[i] for i in sampled] == returned
    assert [sample.logprobs_T[i] for i in sampled] == [x for _, _, g in engine.calls for x in g.logprobs]
    # ...and the logprobs are those of the token in its context (a scoring pass agrees)
    for i in sampled:
        assert sample.logprobs_T[i] == scripted_logprob(sample.token_ids_T[i - 1], sample.token_ids_T[i])
    assert {sample.versions_T[i] for i in sampled} == {3}
    assert all(v == -1 for v, m in zip(sample.versions_T, sample.loss_mask_T) if not m)
    # each request's input is the whole conversation so far; the agent's stop tokens are sent
    for input_ids, sampling, _ in engine.calls:
        assert list(sample.token_ids_T[: len(input_ids)]) == input_ids
        assert set(agent.stop_token_ids) <= set(sampling.stop_token_ids)
    assert sample.task_id == "t1" and traj.task_id == "t1"


async def test_env_exception_becomes_error(policy, agent):
    env = make(FLAKY_ENTRY, fail_rate=1.0)
    traj = await run_episode(env, agent, ScriptedEngine(policy), SamplingParams(), task=TASK)
    assert traj.stop_reason is StopReason.ERROR and traj.failed
    assert traj.error.startswith("env.step: RuntimeError: flaky env failed")
    assert traj.samples and traj.samples[0].stop_reason is StopReason.ERROR


async def test_hanging_env_step_times_out(policy, agent):
    env = make(FLAKY_ENTRY, fail_rate=0.0, hang_rate=1.0)
    traj = await run_episode(env, agent, ScriptedEngine(policy), SamplingParams(), task=TASK,
                             step_timeout_s=0.05)
    assert traj.stop_reason is StopReason.TIMEOUT
    assert "env.step: timed out" in traj.error


async def test_reset_error_and_dead_engine(policy, agent):
    env = make("palaestra/Calculator-v0")
    traj = await run_episode(env, agent, ScriptedEngine(policy), SamplingParams(),
                             task={"answer": "1"})  # no question: initial_messages raises
    assert traj.stop_reason is StopReason.ERROR and traj.error.startswith("env.reset: KeyError")
    assert traj.samples == ()
    engine = ScriptedEngine(policy)
    engine.kill()
    traj = await run_episode(env, agent, engine, SamplingParams(), task=TASK)
    assert traj.stop_reason is StopReason.ERROR and "engine: EngineError" in traj.error


async def test_context_overflow_and_max_tokens(policy, tokenizer_dir):
    env = make("palaestra/Calculator-v0")
    probe = make_agent(tokenizer_dir, "qwen")
    await run_episode(env, probe, ScriptedEngine(policy), SamplingParams(), task=TASK)
    prompt = probe.to_sample(reward=0, stop_reason="terminated").prompt_len
    # room for the first turn but not for the tool result: truncated, not a crash
    small = make_agent(tokenizer_dir, "qwen", max_context=prompt + 40)
    traj = await run_episode(env, small, ScriptedEngine(policy), SamplingParams(), task=TASK)
    assert traj.stop_reason is StopReason.TRUNCATED and traj.error is None
    assert traj.samples[0].num_tokens <= prompt + 40
    traj = await run_episode(env, probe, ScriptedEngine(policy), SamplingParams(max_new_tokens=5),
                             task=TASK)
    assert traj.stop_reason is StopReason.MAX_TOKENS and traj.samples[0].num_sampled == 5


async def test_max_turns_cap(tokenizer_dir, agent):
    env = make("palaestra/Calculator-v0", max_turns=10)
    loop_policy = CalculatorPolicy(tokenizer_dir, n_calls=100)  # never answers
    traj = await run_episode(env, agent, ScriptedEngine(loop_policy), SamplingParams(), task=TASK,
                             max_turns=3)
    assert traj.stop_reason is StopReason.TRUNCATED and len(traj.turns) == 3


async def test_aborted_turn_resumes_from_its_tokens(policy, tokenizer_dir):
    """Abort mid-generation, update the weights, resume: the same tokens, two versions."""
    env = make("palaestra/Calculator-v0")
    reference = await run_episode(env, make_agent(tokenizer_dir), ScriptedEngine(policy),
                                  SamplingParams(seed=7), task=TASK, session_id="a")
    engine = ScriptedEngine(policy, latency_s=0.4)
    agent = make_agent(tokenizer_dir)
    state = EpisodeState()
    run = asyncio.ensure_future(run_episode(env, agent, engine, SamplingParams(seed=7), task=TASK,
                                            session_id="a", state=state))
    await asyncio.sleep(0.2)
    await engine.abort()
    first = await run
    assert first.stop_reason is StopReason.ABORTED and first.samples == ()
    partial = state.partial_tokens
    assert 0 < partial < reference.samples[0].num_sampled
    await engine.update_weights(version=1)
    engine.latency_s = 0.0
    final = await run_episode(env, agent, engine, SamplingParams(seed=7), task=TASK,
                              session_id="a", state=state)
    assert final.stop_reason is StopReason.TERMINATED and final.reward == reference.reward
    got, want = final.samples[0], reference.samples[0]
    assert got.token_ids_T == want.token_ids_T and got.loss_mask_T == want.loss_mask_T
    assert got.logprobs_T == want.logprobs_T
    first_turn = [v for v, m in zip(got.versions_T[: got.turn_ends[0]], got.loss_mask_T) if m]
    assert first_turn[0] == 0 and first_turn[-1] == 1  # one turn, sampled by two versions
    assert first_turn.count(0) == partial
    assert final.metrics["aborts"] == 1


def test_scripted_engine_is_deterministic_per_seed(policy):
    ids = [1, 2, 3]
    a = policy(ids, random.Random(5))
    assert a == policy(ids, random.Random(5))


class FixedReward:
    """The calculator env, but every step's reward is ``reward`` (whatever its type)."""

    def __init__(self, reward):
        self.env = make("palaestra/Calculator-v0")
        self.reward = reward

    async def areset(self, **kwargs):
        return await self.env.areset(**kwargs)

    async def astep(self, action):
        obs, _, terminated, truncated, info = await self.env.astep(action)
        return obs, self.reward, terminated, truncated, info


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), -float("inf"), "1.0", None,
                                    [1.0]], ids=repr)
async def test_a_reward_that_is_not_a_finite_number_fails_the_episode(policy, agent, reward):
    traj = await run_episode(FixedReward(reward), agent, ScriptedEngine(policy), SamplingParams(),
                             task=TASK)
    assert traj.failed and traj.stop_reason is StopReason.ERROR
    assert traj.error.startswith(f"env.step: reward {reward!r} ({type(reward).__name__}) on turn 0")
    assert "is not a finite number" in traj.error
    assert traj.turns == () and traj.reward == 0.0  # the bad value reaches no sum


@pytest.mark.parametrize("reward", [1, True, np.float32(0.5), np.int64(2)], ids=repr)
async def test_numeric_rewards_of_any_type_are_floats(policy, agent, reward):
    traj = await run_episode(FixedReward(reward), agent, ScriptedEngine(policy), SamplingParams(),
                             task=TASK)
    assert not traj.failed and traj.turns[0].reward == float(reward)
    assert type(traj.turns[0].reward) is float

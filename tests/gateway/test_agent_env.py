"""`ExternalAgentEnv` episodes through the gateway: an `openai`-client agent as a callable and as a
sandboxed command, scored by its reward function; crashes, hangs, slow calls and call budgets end
as recorded trajectories and free their sessions."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap

import openai
import pytest

from palaestra.agents import make_agent
from palaestra.envs.external_agent import ExternalAgentEnv
from palaestra.errors import ConfigError
from palaestra.engine import SamplingParams
from palaestra.rollout.play import run_episode
from palaestra.rollout.gateway.agent_episode import close_gateways, gateway_for
from palaestra.types import StopReason

TASK = {"id": "t1", "question": "What is 2 + 3?", "answer": "5"}
SAMPLING = SamplingParams(max_new_tokens=8, seed=11)


@pytest.fixture
def agent(model_dir):
    return make_agent(model_dir, "qwen", max_context=1024)


@pytest.fixture(autouse=True)
async def _stop_gateways():
    yield
    await close_gateways()


async def chatty_agent(base_url: str, task: dict) -> str:
    """Three calls, echoing the replies back; returns the last reply."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="k", max_retries=0)
    messages = [{"role": "user", "content": task["question"]}]
    text = ""
    for k in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        text = reply.choices[0].message.content or ""
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": f"Check step {k}."}]
    return text


def length_reward(task, outcome, messages) -> float:
    assert task["id"] == "t1" and isinstance(outcome, str)
    assert messages[0].content == task["question"] and messages[-1].role == "assistant"
    return 0.25 + len(messages) / 100


async def test_a_callable_agent_becomes_a_scored_token_exact_trajectory(agent, engine, recording):
    rec = recording(engine)
    env = ExternalAgentEnv(chatty_agent, reward_fn=length_reward)
    traj = await run_episode(env, agent, rec, SAMPLING, task=TASK, session_id="g1/0",
                                   env_id="test/Agent-v0", group_id="g1")
    assert traj.stop_reason is StopReason.TERMINATED and traj.error is None
    assert traj.reward == pytest.approx(0.25 + 6 / 100) and len(traj.turns) == 3
    (sample,) = traj.samples
    assert sample.reward == traj.reward and sample.group_id == "g1" and sample.task_id == "t1"
    assert [t for t, m in zip(sample.token_ids_T, sample.loss_mask_T) if m] == [
        t for _, g in rec.calls for t in g.token_ids]
    assert traj.metrics["calls"] == 3 and traj.metrics["prefix_breaks"] == 0
    assert traj.turns[-1].reward == traj.reward
    running = await gateway_for(rec, agent)
    assert running.gateway.sessions == {}  # the session is freed


async def test_a_crashing_agent_gives_a_failed_trajectory_and_frees_its_session(agent, engine):
    urls = []

    async def crash(base_url, task):
        urls.append(base_url)
        client = openai.AsyncOpenAI(base_url=base_url, api_key="k", max_retries=0)
        await client.chat.completions.create(
            model="p", messages=[{"role": "user", "content": task["question"]}])
        raise RuntimeError("boom")

    env = ExternalAgentEnv(crash, reward_fn=length_reward)
    traj = await run_episode(env, agent, engine, SAMPLING, task=TASK)
    assert traj.failed and traj.stop_reason is StopReason.ERROR
    assert traj.error == "agent: RuntimeError: boom" and traj.reward == 0.0
    running = await gateway_for(engine, agent)
    assert running.gateway.sessions == {}
    late = openai.AsyncOpenAI(base_url=urls[0], api_key="k", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        await late.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])


async def test_a_hanging_agent_is_cancelled_at_its_timeout(agent, engine):
    cancelled = asyncio.Event()

    async def hang(base_url, task):
        try:
            await asyncio.sleep(3600)
        finally:
            cancelled.set()

    env = ExternalAgentEnv(hang, reward_fn=length_reward, timeout_s=0.3)
    traj = await run_episode(env, agent, engine, SAMPLING, task=TASK)
    assert traj.stop_reason is StopReason.TIMEOUT and traj.failed
    assert "did not finish within 0.3 s" in traj.error
    assert cancelled.is_set()
    assert (await gateway_for(engine, agent)).gateway.sessions == {}


async def test_a_call_that_outlives_its_timeout_fails_the_episode(agent, engine, recording):
    slow = recording(engine, delay_s=5.0)
    env = ExternalAgentEnv(chatty_agent, reward_fn=length_reward, call_timeout_s=0.2)
    traj = await run_episode(env, agent, slow, SAMPLING, task=TASK)
    assert traj.stop_reason is StopReason.TIMEOUT
    assert traj.error.startswith("agent: a generation took over 0.2 s")


async def test_the_call_budget_truncates_and_still_scores(agent, engine):
    seen = []

    def reward(task, outcome, messages):
        seen.append(outcome)
        return 0.5

    env = ExternalAgentEnv(chatty_agent, reward_fn=reward, max_calls=2)
    traj = await run_episode(env, agent, engine, SAMPLING, task=TASK)
    assert traj.stop_reason is StopReason.TRUNCATED and not traj.failed
    assert traj.reward == 0.5 and seen == [None] and traj.metrics["calls"] == 2


async def test_a_sync_agent_and_a_bad_reward_value(agent, engine):
    def sync_agent(base_url, task):  # plain blocking client code runs in a worker thread
        client = openai.OpenAI(base_url=base_url, api_key="k", max_retries=0)
        out = client.chat.completions.create(
            model="p", messages=[{"role": "user", "content": task["question"]}])
        return out.choices[0].message.content

    env = ExternalAgentEnv(sync_agent, reward_fn=lambda task, outcome, messages: float("nan"))
    traj = await run_episode(env, agent, engine, SAMPLING, task=TASK)
    assert traj.stop_reason is StopReason.ERROR
    assert traj.error.startswith("reward_fn: ValueError: reward_fn returned nan")
    assert len(traj.samples) == 1  # the recorded tokens are kept for inspection


COMMAND_AGENT = textwrap.dedent('''
    import json, os
    from openai import OpenAI   # plain client: OPENAI_BASE_URL / OPENAI_API_KEY from the env
    task = json.loads(os.environ["PALAESTRA_TASK"])
    client = OpenAI(max_retries=0)
    messages = [{"role": "user", "content": task["question"]}]
    for _ in range(2):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "go on"}]
    print(json.dumps({"answer": task["answer"], "turns": len(messages)}))
''')


async def test_a_command_agent_runs_in_the_sandbox_with_the_plain_openai_client(agent, engine):
    def reward(task, outcome, messages):
        return 1.0 if outcome == {"answer": "5", "turns": 5} else 0.0

    env = ExternalAgentEnv(command=["python", "agent.py"], files={"agent.py": COMMAND_AGENT},
                   reward_fn=reward, timeout_s=60)
    traj = await run_episode(env, agent, engine, SAMPLING, task=TASK)
    assert traj.error is None, traj.error
    assert traj.reward == 1.0 and traj.metrics["calls"] == 2 and len(traj.samples) == 1


async def test_a_crashing_command_reports_its_stderr(agent, engine):
    env = ExternalAgentEnv(command=[sys.executable, "-c", "import sys; sys.exit('no luck')"],
                   sandbox=False, reward_fn=length_reward)
    traj = await run_episode(env, agent, engine, SAMPLING, task=TASK)
    assert traj.stop_reason is StopReason.ERROR
    assert traj.error == "agent: AgentCrashError: the agent command exited with 1: no luck"


def test_agent_env_config_errors_and_gym_side():
    with pytest.raises(ConfigError, match="exactly one of agent"):
        ExternalAgentEnv(reward_fn=length_reward)
    with pytest.raises(ConfigError, match="timeout_s must be > 0"):
        ExternalAgentEnv(chatty_agent, reward_fn=length_reward, timeout_s=0)
    env = ExternalAgentEnv("tests.nowhere:agent", reward_fn=length_reward, tools=[{"type": "function"}],
                   task_fn=lambda seed: {"id": f"s{seed % 7}", "question": "?"})
    assert env.tool_schemas() == [{"type": "function"}]
    drawn, _ = env.reset(seed=3)
    assert json.loads(drawn[0].content)["question"] == "?" and env.task["id"].startswith("s")
    obs, info = env.reset(options={"task": TASK})
    assert json.loads(obs[0].content) == TASK and info["task_id"] == "t1"
    with pytest.raises(ConfigError, match="cannot be stepped"):
        env.step("hello")
    with pytest.raises(ConfigError, match="cannot import"):
        env.agent_callable()

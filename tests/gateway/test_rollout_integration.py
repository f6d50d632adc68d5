"""`ExternalAgentEnv` episodes and posted trajectories through the real rollout stack
(`RolloutManager` with in-process workers and a real `LocalEngine`) and through the evaluation
harness: `run_episode` hands each env to the runner of its ``episode_kind``, so workers and the
harness need nothing special."""

from __future__ import annotations

import openai
import pytest

from palaestra.agents import AgentSpec
from palaestra.envs.registry import register
from palaestra.rollout.config import EngineSpec, RolloutConfig, WorkerConfig
from palaestra.rollout.data import DataSource
from palaestra.rollout.manager import RolloutManager
from palaestra.engine import SamplingParams
from palaestra.rollout.gateway.agent_episode import close_gateways
from palaestra.rollout.gateway.buffer import TrajectoryBuffer
from palaestra.rollout.gateway.client import TrajectoryClient
from palaestra.rollout.gateway.external import BufferSource
from palaestra.rollout.gateway.server import serve_gateway

ENV_ID = "palaestra-test/GatewayAgent-v0"


async def two_call_agent(base_url: str, task: dict) -> str:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="k", max_retries=0)
    messages = [{"role": "user", "content": task["question"]}]
    reply = await client.chat.completions.create(model="policy", messages=messages)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "Are you sure?"}]
    reply = await client.chat.completions.create(model="policy", messages=messages)
    return reply.choices[0].message.content or ""


def odd_length_reward(task, outcome, messages) -> float:
    return float(len(outcome or "") % 2)


register(ENV_ID, "palaestra.envs.external_agent:ExternalAgentEnv", agent=two_call_agent,
         reward_fn=odd_length_reward, timeout_s=120)


def rows(n: int) -> list[dict]:
    return [{"env_id": ENV_ID, "id": f"q{i}", "question": f"What is {i} + {i}?"} for i in range(n)]


@pytest.fixture
async def manager_factory(model_dir, engine):
    managers = []

    def build(data, *, batch_size: int) -> RolloutManager:
        config = WorkerConfig(engine=EngineSpec(), agent=AgentSpec(model_dir, max_context=1024),
                              sampling=SamplingParams(max_new_tokens=6))
        manager = RolloutManager(
            data, config, RolloutConfig(batch_size=batch_size, group_size=2, num_workers=1,
                                        max_concurrency=8, max_failure_rate=0.0),
            cluster="local", engine=engine)
        managers.append(manager)
        return manager

    yield build
    for manager in managers:
        await manager.close()
    await close_gateways()


async def test_agent_env_groups_fill_a_manager_batch(manager_factory):
    manager = manager_factory(DataSource(rows(4), seed=1), batch_size=2)
    batch = await manager.generate_batch(0)
    assert len(batch.trajectories) == 4 and not batch.failed
    for traj in batch.trajectories:
        assert traj.env_id == ENV_ID and traj.metrics["calls"] == 2
        (sample,) = traj.samples
        assert sample.group_id == traj.group_id and sample.reward == traj.reward
        assert sample.num_sampled > 0 and len(sample.turn_ends) == 2
    assert batch.metrics["ledger/unaccounted"] == 0 and batch.metrics["groups/kept"] == 2
    # the gateway's counters, summed over the step's episodes
    assert batch.metrics["gateway/episodes"] == 4 and batch.metrics["gateway/calls"] == 8
    assert batch.metrics["gateway/samples"] == 4 and batch.metrics["gateway/prefix_breaks"] == 0


async def test_posted_groups_join_batches_with_generated_groups(manager_factory, tokenizer):
    buffer = TrajectoryBuffer(vocab_size=len(tokenizer), group_size=2, name="it-buffer")
    server = await serve_gateway(None, buffer=buffer)
    try:
        posted = [{"token_ids": [1, 2, 3, 4 + k], "loss_mask": [0, 0, 1, 1],
                   "logprobs": [0, 0, -0.5, -0.25], "reward": float(k), "env_id": "elsewhere"}
                  for k in range(2)]
        await TrajectoryClient(server.url).apost(posted, group_id="ext-1")
    finally:
        await server.close()
    source = BufferSource(buffer, group_size=2, then=DataSource(rows(2), seed=2))
    manager = manager_factory(source, batch_size=2)
    batch = await manager.generate_batch(0)
    external = [t for t in batch.trajectories if t.metrics.get("external")]
    generated = [t for t in batch.trajectories if t.env_id == ENV_ID]
    assert len(external) == 2 and len(generated) == 2
    assert sorted(t.samples[0].token_ids_T for t in external) == [(1, 2, 3, 4), (1, 2, 3, 5)]
    assert {t.group_id for t in external} == {external[0].samples[0].group_id}
    assert external[0].group_id != generated[0].group_id  # the manager's own group ids
    assert batch.metrics["ledger/unaccounted"] == 0 and batch.metrics["groups/kept"] == 2
    assert len({s.group_id for s in batch.samples}) == 2
    assert batch.metrics["gateway/external"] == 2


async def test_the_evaluation_harness_plays_agent_envs(model_dir, engine, tokenizer):
    from palaestra.benchmarks import Benchmark
    from palaestra.benchmarks.runner import EvalSettings, evaluate
    from palaestra.benchmarks.policies import TokenPolicy

    bench = Benchmark(name="gateway-agent", env_id=ENV_ID, dataset=lambda: rows(2), answer=None,
                      max_new_tokens=6, success_threshold=1.0)
    policy = TokenPolicy(engine, tokenizer, model="micro", max_context=1024)
    try:
        summary = await evaluate([bench], policy, EvalSettings(n=2, temperature=1.0),
                                 progress=False, report=False)
    finally:
        await close_gateways()
    result = summary["gateway-agent"]
    assert result["samples"] == 4 and result["tasks"] == 2
    assert 0.0 <= result["pass@1"] <= 1.0 and not result.get("errors")

"""Task rows drawn from an env itself (envs that generate tasks from a seed, e.g. Calculator).

`tasks_from_env` turns ``env.sample_task`` into dataset rows (with their ``env_id``) so such envs
feed the same `DataSource` as file datasets; `evaluate_tasks` plays a fixed list of task rows
once each through `run_episode` (held-out success rate during training), each task with its own
sampling seed (from ``seed`` and its index, unless ``sampling`` has one), so a score never depends
on the order episodes reach the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from palaestra.engine import Engine, SamplingParams
from palaestra.types import Trajectory

if TYPE_CHECKING:
    from palaestra.agents.spec import AgentSpec


def tasks_from_env(
    env_id: str, num_tasks: int, *, seed: int = 0, env_kwargs: Mapping[str, Any] | None = None
) -> list[dict[str, Any]]:
    """``num_tasks`` rows ``{"env_id", **task}`` drawn with ``env.sample_task`` from ``seed``."""
    from palaestra import envs

    env = envs.make(env_id, **dict(env_kwargs or {}))
    rng = np.random.default_rng(seed)
    rows = [{"env_id": env_id, **env.sample_task(rng)} for _ in range(num_tasks)]
    env.close()
    return rows


async def evaluate_tasks(
    engine: Engine,
    agent_spec: AgentSpec,
    env_id: str,
    tasks: Sequence[Mapping[str, Any]],
    sampling: SamplingParams,
    *,
    env_kwargs: Mapping[str, Any] | None = None,
    concurrency: int = 64,
    seed: int = 0,
    pass_threshold: float = 1.0,
) -> tuple[dict[str, float], list[Trajectory]]:
    """Play each task once; success = reward >= ``pass_threshold``. Returns metrics, episodes."""
    from palaestra import envs
    from palaestra.rollout.data import _mix
    from palaestra.rollout.play import run_episode

    limit = asyncio.Semaphore(concurrency)

    async def one(i: int, task: Mapping[str, Any]) -> Trajectory:
        async with limit:
            env = envs.make(env_id, **dict(env_kwargs or {}))
            try:
                row = {k: v for k, v in task.items() if k != "env_id"}
                params = sampling if sampling.seed is not None else replace(
                    sampling, seed=_mix(seed, i, 3))
                return await run_episode(
                    env, agent_spec.build(), engine, params, seed=seed + i, task=row,
                    session_id=f"eval-{seed}-{i}",
                )
            finally:
                env.close()

    episodes = await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
    rewards = np.array([t.reward for t in episodes], dtype=float)
    calls = np.array([t.metrics.get("tool_calls", 0.0) for t in episodes], dtype=float)
    metrics = {
        "success_rate": float(np.mean(rewards >= pass_threshold)) if len(rewards) else 0.0,
        "reward_mean": float(rewards.mean()) if len(rewards) else 0.0,
        "failed": float(sum(t.failed for t in episodes)),
        "tool_calls_mean": float(calls.mean()) if len(calls) else 0.0,  # Search-R1: searches
        "tasks": float(len(episodes)),
    }
    return metrics, list(episodes)

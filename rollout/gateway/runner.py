"""Envs that play their own episodes, and the dispatch `run_episode` needs for them.

An env with an ``episode_runner`` attribute (``"module:function"``) is not stepped by the rollout
loop: its runner plays the whole episode and returns the `Trajectory` (`AgentEnv`: the agent
program talks to the gateway; the external env: a posted trajectory is claimed). A runner has
`run_episode`'s signature. The hook in ``palaestra.rollout.episode.run_episode`` is::

    if getattr(env, "episode_runner", None):
        from palaestra.rollout.gateway.runner import run_owned_episode
        return await run_owned_episode(env, agent, engine, sampling, seed=seed, task=task,
                                       session_id=session_id, max_turns=max_turns,
                                       step_timeout_s=step_timeout_s, env_id=env_id,
                                       group_id=group_id, state=state)

`run_any_episode` is `run_episode` with that dispatch, for callers that cannot wait for the hook.
"""

from __future__ import annotations

import importlib
from typing import Any

from palaestra.errors import ConfigError
from palaestra.rollout.engines.base import Engine, SamplingParams
from palaestra.rollout.episode import run_episode as _run_episode
from palaestra.types import StopReason, Trajectory


def load_runner(spec: str) -> Any:
    """The function named by an env's ``episode_runner`` (``"module:function"``)."""
    module, _, name = str(spec).partition(":")
    if not module or not name:
        raise ConfigError(f"episode_runner must be 'module:function', got {spec!r}")
    fn = getattr(importlib.import_module(module), name, None)
    if fn is None or not callable(fn):
        raise ConfigError(f"episode_runner {spec!r} names nothing callable")
    return fn


async def run_owned_episode(
    env: Any, agent: Any, engine: Engine, sampling: SamplingParams, **kwargs: Any
) -> Trajectory:
    """Play an episode with the env's own runner; a runner that cannot load gives a failed one."""
    try:
        runner = load_runner(env.episode_runner)
    except Exception as exc:  # noqa: BLE001 - a bad rollout is data, not a crash
        return Trajectory(env_id=str(kwargs.get("env_id", "")), task_id="", messages=(),
                          turns=(), samples=(), reward=0.0, stop_reason=StopReason.ERROR,
                          error=f"env.runner: {exc}", group_id=str(kwargs.get("group_id", "")))
    return await runner(env, agent, engine, sampling, **kwargs)


async def run_any_episode(
    env: Any, agent: Any, engine: Engine, sampling: SamplingParams, **kwargs: Any
) -> Trajectory:
    """`run_episode`, or the env's own runner when it has one."""
    if getattr(env, "episode_runner", None):
        return await run_owned_episode(env, agent, engine, sampling, **kwargs)
    return await _run_episode(env, agent, engine, sampling, **kwargs)


__all__ = ["load_runner", "run_any_episode", "run_owned_episode"]

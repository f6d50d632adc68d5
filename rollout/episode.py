"""`run_episode`: the one loop between an env, an agent and an engine (training and evaluation).

Every turn: the agent's token ids go to the engine; the sampled tokens are appended to the agent
exactly as returned and parsed into an assistant message; the env steps on that message; its
observation is rendered by the agent as a delta. Failures never escape as exceptions: an env that
raises, an engine that fails after its retries, an env step that outlives ``step_timeout_s`` or a
context that overflows end the episode with a stop reason (``error``, ``timeout``, ``truncated``)
and the error text on the `Trajectory` -- a bad rollout is data, not a crash. So does a reward
that is not a finite number (NaN, inf, a string, None): the episode fails with the reason instead
of poisoning its group's advantages and the step's loss.

Partial rollout: a generation that comes back with ``finish_reason == "abort"`` (weight update,
shutdown) ends the call with stop reason ``aborted``; its tokens are already in the agent (with the version
of the weights that sampled them). Calling `run_episode` again with the same env, agent and
`EpisodeState` continues that turn from those tokens, so one turn can carry two versions.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import math
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field, replace
from time import perf_counter, thread_time
from typing import Any, TypeVar

from palaestra.rollout.engines.base import Engine, SamplingParams
from palaestra.types import Sample, StopReason, Trajectory, Turn

T = TypeVar("T")


@dataclass
class EpisodeState:
    """Progress of one episode; pass it to `run_episode` again to resume an aborted episode."""

    started: bool = False
    task_id: str = ""
    turns: list[Turn] = field(default_factory=list)
    seed: int | None = None  # the sampling seed of the first request (request k: seed + k)
    partial_tokens: int = 0  # tokens of the current turn sampled before an abort
    requests: int = 0
    aborts: int = 0
    engine_s: float = 0.0
    env_s: float = 0.0
    agent_s: float = 0.0  # CPU time (the agent's calls are synchronous: no queueing in it)
    wall_s: float = 0.0


async def run_episode(
    env: Any,
    agent: Any,
    engine: Engine,
    sampling: SamplingParams,
    *,
    seed: int | None = None,
    task: Mapping[str, Any] | None = None,
    session_id: str | None = None,
    max_turns: int | None = None,
    step_timeout_s: float | None = None,
    env_id: str = "",
    group_id: str = "",
    state: EpisodeState | None = None,
) -> Trajectory:
    """Play one episode (or resume ``state``) and return its trajectory; never raises on failure.

    An env that plays its episodes itself (an external agent program: ``episode_runner =
    "module:function"`` on the env class) is handed to that function with the same arguments.
    """
    runner = getattr(env, "episode_runner", None)
    if runner is not None:
        return await _runner(runner)(  # type: ignore[no-any-return]
            env, agent, engine, sampling, seed=seed, task=task, session_id=session_id,
            max_turns=max_turns, step_timeout_s=step_timeout_s, env_id=env_id,
            group_id=group_id, state=state,
        )
    st = state if state is not None else EpisodeState()
    began = perf_counter()
    env_id = env_id or _env_id(env)
    stop: StopReason | None = None
    error: str | None = None
    stage = "env.reset"
    try:
        if not st.started:
            options = {"task": dict(task)} if task is not None else None
            t = perf_counter()
            obs, info = await _bounded(env.areset(seed=seed, options=options), step_timeout_s)
            st.env_s += perf_counter() - t
            st.task_id = str(info.get("task_id", ""))
            stage = "agent.start"
            t = thread_time()
            agent.start(obs, info.get("tools") or ())
            st.agent_s += thread_time() - t
            st.started = True
        st.seed = sampling.seed
        stops = tuple(dict.fromkeys((*sampling.stop_token_ids, *agent.stop_token_ids)))
        base = replace(sampling, stop_token_ids=stops)
        while stop is None:
            if max_turns is not None and len(st.turns) >= max_turns:
                stop = StopReason.TRUNCATED
                break
            stage = "engine"
            budget = agent.remaining_context()
            if budget <= 0:
                stop = StopReason.TRUNCATED
                break
            # a resumed turn may only sample what its first part left of the per-turn budget
            turn_budget = base.max_new_tokens - st.partial_tokens
            if turn_budget <= 0:
                stop = StopReason.MAX_TOKENS
                break
            max_new = min(turn_budget, budget)
            params = base if max_new == base.max_new_tokens else replace(base, max_new_tokens=max_new)
            if base.seed is not None:
                params = replace(params, seed=base.seed + st.requests)
            rid = f"{session_id}:{st.requests}" if session_id else None
            st.requests += 1
            t = perf_counter()
            gen = await engine.generate(agent.input_ids, params, request_id=rid, session_id=session_id)
            st.engine_s += perf_counter() - t
            stage = "agent.parse"
            t = thread_time()
            action = agent.on_generation(gen)  # an aborted turn is continued by the next call
            st.agent_s += thread_time() - t
            if gen.finish_reason == "abort":
                st.partial_tokens += len(gen.token_ids)
                st.aborts += 1
                stop = StopReason.ABORTED
                break
            st.partial_tokens = 0
            if gen.finish_reason == "length":
                stop = StopReason.TRUNCATED if max_new < turn_budget else StopReason.MAX_TOKENS
                break
            stage = "env.step"
            t = perf_counter()
            obs, reward, terminated, truncated, info = await _bounded(env.astep(action), step_timeout_s)
            st.env_s += perf_counter() - t
            value = finite_reward(reward)
            if value is None:
                stop = StopReason.ERROR
                error = (f"env.step: reward {reward!r} ({type(reward).__name__}) on turn "
                         f"{len(st.turns)} is not a finite number; the env's reward must be an "
                         "int or float")
                break
            st.turns.append(Turn(action, obs, value, info))
            if terminated or truncated:
                default = StopReason.TERMINATED if terminated else StopReason.TRUNCATED
                stop = StopReason(info.get("stop_reason") or default)
                break
            stage = "agent.observe"
            t = thread_time()
            if not agent.on_observation(obs):
                stop = StopReason.TRUNCATED
            st.agent_s += thread_time() - t
    except (TimeoutError, asyncio.TimeoutError) as exc:
        limit = f" after {step_timeout_s} s" if stage.startswith("env") and step_timeout_s else ""
        stop, error = StopReason.TIMEOUT, f"{stage}: timed out{limit} {exc}".rstrip()
    except Exception as exc:  # noqa: BLE001 -- a bad rollout is data, not a crash
        stop, error = StopReason.ERROR, f"{stage}: {type(exc).__name__}: {exc}"
    st.wall_s += perf_counter() - began
    return _trajectory(st, agent, stop, error, env_id, group_id)


def _trajectory(
    st: EpisodeState,
    agent: Any,
    stop: StopReason,
    error: str | None,
    env_id: str,
    group_id: str,
) -> Trajectory:
    turn_rewards = tuple(t.reward for t in st.turns)
    reward = float(sum(turn_rewards))
    samples: tuple[Sample, ...] = ()
    messages: tuple[Any, ...] = ()
    if st.started and stop is not StopReason.ABORTED:
        try:
            sample = agent.to_sample(
                reward=reward,
                turn_rewards=turn_rewards,
                stop_reason=stop,
                env_id=env_id,
                task_id=st.task_id,
                group_id=group_id,
            )
            samples = (sample,)
            messages = tuple(agent.messages)
        except Exception as exc:  # noqa: BLE001 -- recorded on the trajectory
            stop = StopReason.ERROR
            error = error or f"agent.to_sample: {type(exc).__name__}: {exc}"
    tool_calls = sum(int(t.info.get("tool_calls", 0)) for t in st.turns)
    tool_errors = sum(int(t.info.get("tool_errors", 0)) for t in st.turns)
    metrics = {
        "turns": float(len(st.turns)),
        "tool_calls": float(tool_calls),
        "tool_errors": float(tool_errors),
        "response_tokens": float(samples[0].num_sampled) if samples else 0.0,
        "total_tokens": float(samples[0].num_tokens) if samples else 0.0,
        "engine_s": st.engine_s,
        "env_s": st.env_s,
        "agent_s": st.agent_s,
        "wall_s": st.wall_s,
        "requests": float(st.requests),
        "aborts": float(st.aborts),
    }
    if st.seed is not None:
        metrics["seed"] = float(st.seed)  # exact in a float: seeds are 31-bit
    sandbox_s = sum(float(t.info.get("sandbox_s", 0.0)) for t in st.turns)
    if sandbox_s:
        metrics["sandbox_s"] = sandbox_s
    if samples:
        metrics.update({k: float(v) for k, v in samples[0].metrics.items()})
    return Trajectory(
        env_id=env_id,
        task_id=st.task_id,
        messages=messages,
        turns=tuple(st.turns),
        samples=samples,
        reward=reward,
        stop_reason=stop,
        error=error,
        metrics=metrics,
        group_id=group_id,
    )


def finite_reward(reward: Any) -> float | None:
    """``reward`` as a float, or None when it is not a finite number (NaN, inf, str, None...)."""
    if isinstance(reward, (str, bytes, bytearray)):  # float("1") would accept them
        return None
    try:
        value = float(reward)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


@functools.cache
def _runner(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _env_id(env: Any) -> str:
    spec = getattr(env, "spec", None)
    return str(getattr(spec, "id", "") or type(env).__name__)


async def _bounded(awaitable: Awaitable[T], timeout_s: float | None) -> T:
    if timeout_s is None:
        return await awaitable
    if hasattr(asyncio, "timeout"):  # 3.11+: no extra task per call
        async with asyncio.timeout(timeout_s):
            return await awaitable
    return await asyncio.wait_for(awaitable, timeout_s)


__all__ = ["EpisodeState", "finite_reward", "run_episode"]

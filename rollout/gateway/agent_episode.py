"""`run_agent_episode`: one `ExternalAgentEnv` episode, played by the agent program through the
gateway.

The runner of ``EpisodeKind.EXTERNAL_AGENT`` in `palaestra.rollout.play.RUNNERS`: it takes the
same `EpisodeRequest` and gives the same output as the stepped loop (a `Trajectory` with
token-exact `Sample`s, never an exception), so rollout workers and the evaluation harness play
`ExternalAgentEnv`s like any env. The request's player must be a `TokenPlayer`: its agent (the
tokenizer, family and context length) configures the gateway in front of its engine.

1. The env is reset with the task; a gateway in front of the caller's engine (one per event
   loop, engine and tokenizer, started on first use, see `gateway_for`) opens a session with the
   episode's limits: the rollout's sampling parameters, ``max_calls`` (the env's, capped by
   ``max_turns``), ``call_timeout_s`` (the env's, capped by ``step_timeout_s``) and the agent's
   context length.
2. The agent program runs against the session's base URL until it returns, crashes, outlives
   ``timeout_s`` or hits a limit of its session; a hung or crashed agent is cancelled (a command
   is killed) and the session is freed in every case, so its later calls get 404.
3. A finished agent (or one cut short by ``max_calls``/context, with outcome None, stop reason
   ``truncated``) is scored by ``reward_fn``; a crash, hang, call timeout or engine failure gives a
   failed trajectory (stop reason ``error``/``timeout``) with the error text and reward 0.
4. Each sample of the session becomes one `Sample` with the episode's reward; the conversation of
   the last-used sample becomes the trajectory's messages, and ``prefix_breaks``, ``calls``,
   ``samples``, ``exact_continuations``/``reconciled_continuations`` and token counts its metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import uuid
from time import perf_counter
from typing import TYPE_CHECKING, Any

from palaestra.engine import TokenGenerator
from palaestra.episode_info import ResetInfo
from palaestra.rollout.episode import EpisodeRequest, TokenPlayer, failed_trajectory
from palaestra.rollout.gateway.gateway import Gateway
from palaestra.rollout.gateway.server import RunningGateway, serve_gateway
from palaestra.rollout.gateway.session import STOP_REASONS, Session
from palaestra.types import StopReason, Trajectory

if TYPE_CHECKING:
    from palaestra.envs.external_agent import ExternalAgentEnv

CANCEL_GRACE_S = 5.0
_GATEWAYS: dict[tuple[Any, ...], tuple[asyncio.AbstractEventLoop, asyncio.Task[RunningGateway]]] = {}


async def gateway_for(engine: TokenGenerator, agent: Any, *, unix_socket: bool = False
                      ) -> RunningGateway:
    """The gateway server of this loop for ``engine`` and the agent's tokenizer and family.

    Started on first use on 127.0.0.1 (and a Unix socket when ``unix_socket``), then shared by
    every episode of the process that uses the same engine; `close_gateways` stops them.
    """
    loop = asyncio.get_running_loop()
    key = (id(loop), id(engine), id(agent.tokenizer), agent.renderer, agent.max_context,
           agent.enable_thinking, unix_socket)
    entry = _GATEWAYS.get(key)
    if entry is None or entry[0] is not loop or (entry[1].done() and entry[1].exception()):
        task = loop.create_task(_start(engine, agent, unix_socket))
        _GATEWAYS[key] = (loop, task)
        entry = _GATEWAYS[key]
    return await asyncio.shield(entry[1])


async def _start(engine: TokenGenerator, agent: Any, unix_socket: bool) -> RunningGateway:
    gateway = Gateway(engine, agent.tokenizer, agent.renderer, max_context=agent.max_context,
                      enable_thinking=agent.enable_thinking)
    unix_path = None
    if unix_socket:
        folder = tempfile.mkdtemp(prefix="palaestra-gw-")
        os.chmod(folder, 0o755)
        unix_path = os.path.join(folder, "gateway.sock")
    return await serve_gateway(gateway, unix_path=unix_path)


async def close_gateways() -> None:
    """Stop the gateways started by `gateway_for` in this loop."""
    loop = asyncio.get_running_loop()
    for key, (owner, task) in list(_GATEWAYS.items()):
        if owner is loop:
            del _GATEWAYS[key]
            if task.done() and task.exception() is None:
                await task.result().close()


async def run_agent_episode(request: EpisodeRequest) -> Trajectory:
    """Play one `ExternalAgentEnv` episode (see the module docstring); never raises on failure.

    ``request.state`` is not used: aborted generations are resumed inside the gateway instead.
    """
    began = perf_counter()
    env, env_id, group_id = request.env, request.resolved_env_id, request.group_id
    max_turns, step_timeout_s = request.max_turns, request.step_timeout_s
    player = request.player
    try:
        from palaestra.envs.external_agent import ExternalAgentEnv

        if not isinstance(env, ExternalAgentEnv):  # the runner of EpisodeKind.EXTERNAL_AGENT
            raise TypeError(f"the external-agent episode plays an ExternalAgentEnv, got "
                            f"{type(env).__name__}")
        if not isinstance(player, TokenPlayer):
            raise TypeError(
                f"an external agent program needs a token-level engine and agent (a TokenPlayer)"
                f" to serve it through the gateway, got {type(player).__name__}")
        agent, engine = player.agent, player.engine
        _, info = env.reset(seed=request.seed, options=request.reset_options())
        task_row = dict(env.task or {})  # set by reset
        task_id = ResetInfo.from_info(info).task_id
        running = await gateway_for(engine, agent, unix_socket=env.uses_sandbox)
        gateway = running.gateway
        if gateway is None:
            raise RuntimeError("the gateway server serves no gateway")
    except Exception as exc:  # noqa: BLE001 - a bad rollout is data, not a crash
        return failed_trajectory(request, f"agent.setup: {type(exc).__name__}: {exc}",
                                 str((request.task or {}).get("id", "")))
    session_id, sampling = request.session_id, request.sampling
    max_calls = env.max_calls if max_turns is None else min(env.max_calls, max_turns)
    timeouts = [t for t in (env.call_timeout_s, step_timeout_s) if t is not None]
    sid = f"{session_id or 'episode'}-{uuid.uuid4().hex[:12]}".replace("/", "-")
    session = gateway.open_session(
        sid, sampling=sampling, max_calls=max_calls,
        call_timeout_s=min(timeouts) if timeouts else None, max_context=agent.max_context,
        metadata={"task_id": task_id, "group_id": group_id, "env_id": env_id})
    try:
        outcome, stop, error = await _drive(env, running, session, task_row)
    finally:
        with contextlib.suppress(Exception):
            gateway.close_session(sid)
    reward = 0.0
    if stop in (StopReason.TERMINATED, StopReason.TRUNCATED):
        try:
            reward = await env.score(task_row, outcome, session.messages())
        except Exception as exc:  # noqa: BLE001 - a failing reward function fails the episode
            stop, error = StopReason.ERROR, f"reward_fn: {type(exc).__name__}: {exc}"
    samples = session.to_samples(reward=reward, stop_reason=stop, env_id=env_id,
                                 task_id=task_id, group_id=group_id)
    if not samples and error is None:
        stop, error = StopReason.ERROR, "agent: finished without calling the model"
    metrics = session.metrics()
    wall = perf_counter() - began
    engine_s = metrics.pop("engine_ms", 0.0) / 1000.0
    metrics.update(
        turns=float(session.calls),
        requests=float(session.calls),
        response_tokens=float(sum(s.num_sampled for s in samples)),
        total_tokens=float(sum(s.num_tokens for s in samples)),
        engine_s=engine_s,
        env_s=max(wall - engine_s, 0.0),
        wall_s=wall,
    )
    return Trajectory(
        env_id=env_id, task_id=task_id, messages=session.messages(),
        turns=session.turns(reward), samples=samples, reward=reward, stop_reason=stop,
        error=error, metrics=metrics, group_id=group_id,
    )


async def _drive(env: ExternalAgentEnv, running: RunningGateway, session: Session,
                 task: dict[str, Any]) -> tuple[Any, StopReason, str | None]:
    """Run the agent until it returns, fails, times out or its session stops."""
    agent_task = asyncio.ensure_future(_run_agent(env, running, session, task))
    stop_wait = asyncio.ensure_future(session.stopped.wait())
    try:
        done, _ = await asyncio.wait({agent_task, stop_wait}, timeout=env.timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the rollout itself is shutting down: stop the agent too
        agent_task.cancel()
        raise
    finally:
        stop_wait.cancel()
    if agent_task in done:
        exc = agent_task.exception()
        if exc is None:
            if session.stop_reason is not None:  # a limit was hit but the agent still answered
                return agent_task.result(), STOP_REASONS[session.stop_reason], _limit_error(session)
            return agent_task.result(), StopReason.TERMINATED, None
        if session.stop_reason is not None:  # it crashed on the refused call
            return None, STOP_REASONS[session.stop_reason], _limit_error(session)
        if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
            return None, StopReason.TIMEOUT, f"agent: {exc}"
        return None, StopReason.ERROR, f"agent: {type(exc).__name__}: {exc}"
    await _cancel(agent_task)
    if session.stop_reason is not None:
        return None, STOP_REASONS[session.stop_reason], _limit_error(session)
    return None, StopReason.TIMEOUT, f"agent: did not finish within {env.timeout_s} s"


def _limit_error(session: Session) -> str | None:
    stop = STOP_REASONS[session.stop_reason or "closed"]
    if stop is StopReason.TRUNCATED:
        return None
    prefix = "engine" if session.stop_reason == "engine_error" else "agent"
    detail = session.stop_detail.removeprefix("engine: ")
    return f"{prefix}: {detail}"


async def _run_agent(env: ExternalAgentEnv, running: RunningGateway, session: Session,
                     task: dict[str, Any]) -> Any:
    if env.command is None:
        return await env.call_agent(running.base_url(session.id), task)
    from palaestra.rollout.gateway import command

    if env.uses_sandbox:
        assert running.unix_path is not None
        return await command.run_in_sandbox(
            env, session_path=f"/sessions/{session.id}/v1", unix_path=running.unix_path,
            task=task, timeout_s=env.timeout_s)
    return await command.run_subprocess(env, base_url=running.base_url(session.id), task=task,
                                        timeout_s=env.timeout_s)


async def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancel the agent and give it a moment; an agent that ignores cancellation is left."""
    task.cancel()
    await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
    if task.done() and not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" warning
    elif not task.done():
        task.add_done_callback(lambda t: t.cancelled() or t.exception())


__all__ = ["close_gateways", "gateway_for", "run_agent_episode"]

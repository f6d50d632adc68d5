"""The one episode loop: `EpisodeRequest` in, `Trajectory` out, for training and evaluation.

`palaestra.rollout.play.play_episode(request)` looks at the env's ``episode_kind``
(`palaestra.episode_info.EpisodeKind`) and hands the request to that kind's runner in
`palaestra.rollout.play.RUNNERS` (this module imports nothing of the gateway):

- ``stepped`` (every gymnasium env): `play_stepped`, the loop below;
- ``external_agent`` (`palaestra.envs.ExternalAgentEnv`): the agent program plays its episode
  through the agent gateway (`palaestra.rollout.gateway.agent_episode.run_agent_episode`);
- ``posted`` (the gateway's external env): one trajectory posted to the buffer is claimed
  (`palaestra.rollout.gateway.external.run_external_episode`).

`play_stepped`: every turn the request's `Player` produces the assistant message, the env steps
on it, the player takes the observation. Two players exist: `TokenPlayer` (an `Agent` and an
`Engine`: token ids in, sampled ids appended exactly, the training path) and the message-level
`palaestra.benchmarks.chat_episode.ChatPlayer` (a chat API, for evaluating API models).
Failures never escape as exceptions: an env that raises, an engine that fails after its retries,
an env step that outlives ``step_timeout_s`` or a context that overflows end the episode with a
stop reason (``error``, ``timeout``, ``truncated``) and the error text on the `Trajectory` -- a
bad rollout is data, not a crash. So does a reward that is not a finite number (NaN, inf, a
string, None): the episode fails with the reason instead of poisoning its group's advantages.

Partial rollout: a generation that comes back with ``finish_reason == "abort"`` (weight update,
shutdown) ends the call with stop reason ``aborted``; its tokens are already in the agent (with
the version of the weights that sampled them). Playing the same request again with the same
`EpisodeState` continues that turn from those tokens, so one turn can carry two versions.

Branching and checkpoints: ``halt_at_turn`` stops the loop before that turn with the episode
still live (stop reason ``aborted``, ``state.halted_at`` set, no sample), so a branching group
(`palaestra.rollout.branching`) can fork it there, and ``state.turn_requests`` is the request
count at the start of the current turn, where `palaestra.rollout.inflight` rolls a saved
episode back to (its resumed turn then samples with the same seed).

`palaestra.rollout.play.run_episode(env, agent, engine, sampling, ...)` is the token-level request
written as a call.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from time import perf_counter, thread_time
from typing import TYPE_CHECKING, Any, Protocol, SupportsFloat, SupportsIndex, TypeVar

from palaestra.engine import SamplingParams, TokenGenerator
from palaestra.episode_info import ResetInfo, StepInfo
from palaestra.trace_ranges import span
from palaestra.types import Message, Sample, StopReason, Trajectory, Turn

if TYPE_CHECKING:
    from palaestra.agents.agent import Agent
    from palaestra.contracts import RolloutEnv

T = TypeVar("T")


@dataclass
class EpisodeState:
    """Progress of one episode; play the same request with it again to resume an aborted one."""

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
    stage: str = "env.reset"  # what the episode was doing (named in an error)
    halted_at: int | None = None  # turns played when ``halt_at_turn`` stopped the loop
    turn_requests: int = 0  # ``requests`` when the current turn began (a resume rolls back to it)


@dataclass(frozen=True)
class Move:
    """A player's turn: the assistant message, or the stop reason that ends the episode first
    (``action`` may be set with ``stop``: a cut-off message is kept in the conversation)."""

    action: Message | None = None
    stop: StopReason | None = None


@dataclass(frozen=True)
class Outcome:
    """What a player adds to the trajectory when the episode ends."""

    samples: tuple[Sample, ...] = ()
    messages: tuple[Message, ...] = ()
    metrics: Mapping[str, float] = field(default_factory=dict)
    error: str | None = None  # set when building the result failed (the episode fails)


class Player(Protocol):
    """Who writes the assistant's turns of a stepped episode (see the module docstring)."""

    def start(self, observation: Sequence[Message], reset: ResetInfo, st: EpisodeState) -> None:
        """Begin the episode with the env's first observation."""

    async def act(self, request: EpisodeRequest, st: EpisodeState) -> Move:
        """The next assistant message (set ``st.stage`` to what is running, for errors)."""

    def observe(self, observation: Sequence[Message], st: EpisodeState) -> bool:
        """Take the env's answer; False when it does not fit (the episode is truncated)."""

    def outcome(self, request: EpisodeRequest, st: EpisodeState, stop: StopReason) -> Outcome:
        """Samples, conversation and metrics of the episode as it ended (``st.started`` False:
        the reset failed; stop reason ``aborted``: it is resumed later, no sample yet)."""


@dataclass(frozen=True)
class EpisodeRequest:
    """One episode to play: the env, who plays it, how to sample, and the episode's limits.

    ``state``: pass the `EpisodeState` of an aborted episode to resume it (token level).
    """

    env: RolloutEnv  # its class's ``episode_kind`` picks the runner (a runner narrows it)
    player: Player
    sampling: SamplingParams
    seed: int | None = None
    task: Mapping[str, Any] | None = None
    session_id: str | None = None
    max_turns: int | None = None
    step_timeout_s: float | None = None
    env_id: str = ""
    group_id: str = ""
    state: EpisodeState | None = None
    #: stop before sampling turn ``halt_at_turn`` (0-based), the episode still live: stop reason
    #: ``aborted`` with ``state.halted_at`` set, no sample; a branching group forks it there
    halt_at_turn: int | None = None

    @property
    def resolved_env_id(self) -> str:
        """``env_id``, else the env's registered id, else its class name."""
        spec = getattr(self.env, "spec", None)
        return self.env_id or str(getattr(spec, "id", "") or type(self.env).__name__)

    def reset_options(self) -> dict[str, Any] | None:
        return {"task": dict(self.task)} if self.task is not None else None


EpisodeRunner = Callable[[EpisodeRequest], Awaitable[Trajectory]]


# ---------------------------------------------------------------------- the stepped loop
async def play_stepped(request: EpisodeRequest) -> Trajectory:
    """The reset/act/step/observe loop of a stepped env (see the module docstring)."""
    env, player, timeout_s = request.env, request.player, request.step_timeout_s
    st = request.state if request.state is not None else EpisodeState()
    began = perf_counter()
    stop: StopReason | None = None
    error: str | None = None
    try:
        if not st.started:
            st.stage = "env.reset"
            t = perf_counter()
            with span("env_agent"):
                obs, info = await _bounded(env.areset(seed=request.seed,
                                                      options=request.reset_options()), timeout_s)
            st.env_s += perf_counter() - t
            reset = ResetInfo.from_info(info)
            st.task_id = reset.task_id
            player.start(obs, reset, st)
            st.started = True
        st.seed = request.sampling.seed
        while stop is None:
            if request.max_turns is not None and len(st.turns) >= request.max_turns:
                stop = StopReason.TRUNCATED
                break
            if request.halt_at_turn is not None and len(st.turns) >= request.halt_at_turn:
                st.halted_at, stop = len(st.turns), StopReason.ABORTED
                break
            move = await player.act(request, st)
            if move.stop is not None or move.action is None:
                stop = move.stop or StopReason.ERROR
                break
            st.stage = "env.step"
            t = perf_counter()
            with span("env_agent"):
                obs, reward, terminated, truncated, info = await _bounded(
                    env.astep(move.action), timeout_s)
            st.env_s += perf_counter() - t
            value = finite_reward(reward)
            if value is None:
                stop = StopReason.ERROR
                error = (f"env.step: reward {reward!r} ({type(reward).__name__}) on turn "
                         f"{len(st.turns)} is not a finite number; the env's reward must be an "
                         "int or float")
                break
            step = StepInfo.from_info(info)
            st.turns.append(Turn(move.action, tuple(obs), value, info))
            st.turn_requests = st.requests
            if terminated or truncated:
                default = StopReason.TERMINATED if terminated else StopReason.TRUNCATED
                stop = step.stop_reason or default
                break
            st.stage = "agent.observe"
            if not player.observe(obs, st):
                stop = StopReason.TRUNCATED
    except (TimeoutError, asyncio.TimeoutError) as exc:
        stage = st.stage
        limit = f" after {timeout_s} s" if stage.startswith("env") and timeout_s else ""
        stop, error = StopReason.TIMEOUT, f"{stage}: timed out{limit} {exc}".rstrip()
    except Exception as exc:  # noqa: BLE001 -- a bad rollout is data, not a crash
        stop, error = StopReason.ERROR, f"{st.stage}: {type(exc).__name__}: {exc}"
    st.wall_s += perf_counter() - began
    return _trajectory(request, st, stop, error)


def _trajectory(
    request: EpisodeRequest, st: EpisodeState, stop: StopReason, error: str | None
) -> Trajectory:
    turn_rewards = tuple(t.reward for t in st.turns)
    reward = float(sum(turn_rewards))
    outcome = request.player.outcome(request, st, stop)
    if outcome.error is not None:
        stop, error = StopReason.ERROR, error or outcome.error
    steps = [StepInfo.from_info(t.info) for t in st.turns]
    metrics = {
        "turns": float(len(st.turns)),
        "tool_calls": float(sum(s.tool_calls or 0 for s in steps)),
        "tool_errors": float(sum(s.tool_errors or 0 for s in steps)),
        "engine_s": st.engine_s,
        "env_s": st.env_s,
        "wall_s": st.wall_s,
        "requests": float(st.requests),
    }
    sandbox_s = sum(s.sandbox_s or 0.0 for s in steps)
    if sandbox_s:
        metrics["sandbox_s"] = sandbox_s
    metrics.update(outcome.metrics)
    return Trajectory(
        env_id=request.resolved_env_id,
        task_id=st.task_id,
        messages=outcome.messages,
        turns=tuple(st.turns),
        samples=outcome.samples,
        reward=reward,
        stop_reason=stop,
        error=error,
        metrics=metrics,
        group_id=request.group_id,
    )


def failed_trajectory(request: EpisodeRequest, error: str, task_id: str = "") -> Trajectory:
    """The trajectory of an episode that could not be played (stop reason ``error``)."""
    return Trajectory(env_id=request.resolved_env_id, task_id=task_id, messages=(), turns=(),
                      samples=(), reward=0.0, stop_reason=StopReason.ERROR, error=error,
                      group_id=request.group_id)


# ---------------------------------------------------------------------- the token-level player
class TokenPlayer:
    """Turns sampled by an `Engine` from an `Agent`'s exact token ids (the training path)."""

    def __init__(self, agent: Agent, engine: TokenGenerator) -> None:
        self.agent = agent
        self.engine = engine

    def start(self, observation: Sequence[Message], reset: ResetInfo, st: EpisodeState) -> None:
        st.stage = "agent.start"
        t = thread_time()
        with span("env_agent"):
            self.agent.start(observation, reset.tools)
        st.agent_s += thread_time() - t

    async def act(self, request: EpisodeRequest, st: EpisodeState) -> Move:
        agent = self.agent
        base = _with_stops(request.sampling, agent.stop_token_ids)
        st.stage = "engine"
        budget = agent.remaining_context()
        if budget <= 0:
            return Move(stop=StopReason.TRUNCATED)
        # a resumed turn may only sample what its first part left of the per-turn budget
        turn_budget = base.max_new_tokens - st.partial_tokens
        if turn_budget <= 0:
            return Move(stop=StopReason.MAX_TOKENS)
        max_new = min(turn_budget, budget)
        params = base if max_new == base.max_new_tokens else _evolve(base, max_new_tokens=max_new)
        if base.seed is not None:
            params = _evolve(params, seed=base.seed + st.requests)
        sid = request.session_id
        rid = f"{sid}:{st.requests}" if sid else None
        st.requests += 1
        t = perf_counter()
        gen = await self.engine.generate(agent.input_ids, params, request_id=rid, session_id=sid)
        st.engine_s += perf_counter() - t
        st.stage = "agent.parse"
        t = thread_time()
        with span("env_agent"):
            action = agent.on_generation(gen)  # an aborted turn is continued by the next call
        st.agent_s += thread_time() - t
        if gen.finish_reason == "abort":
            st.partial_tokens += len(gen.token_ids)
            st.aborts += 1
            return Move(action, StopReason.ABORTED)
        st.partial_tokens = 0
        if gen.finish_reason == "length":
            stop = StopReason.TRUNCATED if max_new < turn_budget else StopReason.MAX_TOKENS
            return Move(action, stop)
        return Move(action)

    def observe(self, observation: Sequence[Message], st: EpisodeState) -> bool:
        t = thread_time()
        try:
            with span("env_agent"):
                return self.agent.on_observation(observation)
        finally:
            st.agent_s += thread_time() - t

    def outcome(self, request: EpisodeRequest, st: EpisodeState, stop: StopReason) -> Outcome:
        metrics: dict[str, float] = {"agent_s": st.agent_s, "aborts": float(st.aborts),
                                     "response_tokens": 0.0, "total_tokens": 0.0}
        if st.seed is not None:
            metrics["seed"] = float(st.seed)  # exact in a float: seeds are 31-bit
        if not st.started or stop is StopReason.ABORTED:
            return Outcome(metrics=metrics)
        try:
            sample = self.agent.to_sample(
                reward=float(sum(t.reward for t in st.turns)),
                turn_rewards=tuple(t.reward for t in st.turns),
                stop_reason=stop,
                env_id=request.resolved_env_id,
                task_id=st.task_id,
                group_id=request.group_id,
            )
        except Exception as exc:  # noqa: BLE001 -- recorded on the trajectory
            return Outcome(metrics=metrics, error=f"agent.to_sample: {type(exc).__name__}: {exc}")
        metrics["response_tokens"] = float(sample.num_sampled)
        metrics["total_tokens"] = float(sample.num_tokens)
        metrics.update({k: float(v) for k, v in sample.metrics.items()})
        return Outcome((sample,), tuple(self.agent.messages), metrics)


# ---------------------------------------------------------------------- helpers
@functools.lru_cache(maxsize=64)
def _with_stops(sampling: SamplingParams, stops: tuple[int, ...]) -> SamplingParams:
    """``sampling`` with the agent's stop tokens added (one per run's settings, not per turn)."""
    merged = tuple(dict.fromkeys((*sampling.stop_token_ids, *stops)))
    return sampling if merged == sampling.stop_token_ids else replace(
        sampling, stop_token_ids=merged)


def _evolve(params: SamplingParams, **changes: int) -> SamplingParams:
    """``params`` with fields changed to values that keep it valid (a token budget >= 1, a
    seed), without `SamplingParams` validating its every field again on each turn."""
    out = copy.copy(params)
    for name, value in changes.items():
        object.__setattr__(out, name, value)
    return out


def finite_reward(reward: object) -> float | None:
    """``reward`` as a float, or None when it is not a finite number (NaN, inf, str, None...)."""
    if not isinstance(reward, (SupportsFloat, SupportsIndex)) or isinstance(reward, str):
        return None  # float("1") would accept a string
    try:
        value = float(reward)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


async def _bounded(awaitable: Awaitable[T], timeout_s: float | None) -> T:
    if timeout_s is None:
        return await awaitable
    if hasattr(asyncio, "timeout"):  # 3.11+: no extra task per call
        async with asyncio.timeout(timeout_s):
            return await awaitable
    return await asyncio.wait_for(awaitable, timeout_s)


__all__ = [
    "EpisodeRequest",
    "EpisodeRunner",
    "EpisodeState",
    "Move",
    "Outcome",
    "Player",
    "TokenPlayer",
    "failed_trajectory",
    "finite_reward",
    "play_stepped",
]

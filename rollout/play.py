"""`play_episode`: one episode of any kind, dispatched on the env's ``episode_kind``.

`RUNNERS` maps each `palaestra.episode_info.EpisodeKind` to its runner:

- ``stepped`` (every gymnasium env): `palaestra.rollout.episode.play_stepped`;
- ``external_agent`` (`palaestra.envs.ExternalAgentEnv`): the agent program plays its episode
  through the agent gateway (`palaestra.rollout.gateway.agent_episode.run_agent_episode`);
- ``posted`` (the gateway's external env): one trajectory posted to the buffer is claimed
  (`palaestra.rollout.gateway.external.run_external_episode`).

This module sits above both `palaestra.rollout.episode` (the loop and its types) and the gateway
(which plays through the loop's types), so neither imports the other's caller: the episode
module imports nothing of the gateway. A caller may hand `play_episode` its own table
(``runners=``); `run_episode` is the token-level request written as a call.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from palaestra.engine import SamplingParams, TokenGenerator
from palaestra.episode_info import EpisodeKind
from palaestra.rollout.episode import (
    EpisodeRequest,
    EpisodeRunner,
    EpisodeState,
    TokenPlayer,
    failed_trajectory,
    play_stepped,
)
from palaestra.types import Trajectory

if TYPE_CHECKING:
    from palaestra.agents.agent import Agent
    from palaestra.contracts import RolloutEnv


async def _external_agent(request: EpisodeRequest) -> Trajectory:
    from palaestra.rollout.gateway.agent_episode import run_agent_episode

    return await run_agent_episode(request)


async def _posted(request: EpisodeRequest) -> Trajectory:
    from palaestra.rollout.gateway.external import run_external_episode

    return await run_external_episode(request)


#: the runner of each episode kind (read-only: a kind is part of the env contract in core)
RUNNERS: Mapping[EpisodeKind, EpisodeRunner] = MappingProxyType({
    EpisodeKind.STEPPED: play_stepped,
    EpisodeKind.EXTERNAL_AGENT: _external_agent,
    EpisodeKind.POSTED: _posted,
})


async def play_episode(request: EpisodeRequest,
                       runners: Mapping[EpisodeKind, EpisodeRunner] = RUNNERS) -> Trajectory:
    """Play one episode with the runner of the env's kind; never raises on failure."""
    kind = getattr(request.env, "episode_kind", EpisodeKind.STEPPED)
    runner = runners.get(kind)
    if runner is None:
        known = ", ".join(k.value for k in runners)
        return failed_trajectory(request, f"episode: {type(request.env).__name__} declares "
                                 f"episode_kind {kind!r}; known kinds: {known}")
    return await runner(request)


async def run_episode(
    env: RolloutEnv,
    agent: Agent,
    engine: TokenGenerator,
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
    halt_at_turn: int | None = None,
) -> Trajectory:
    """Play one token-level episode (or resume ``state``): `play_episode` of the request with a
    `TokenPlayer` of ``agent`` and ``engine``; never raises on failure."""
    return await play_episode(EpisodeRequest(
        env, TokenPlayer(agent, engine), sampling, seed=seed, task=task, session_id=session_id,
        max_turns=max_turns, step_timeout_s=step_timeout_s, env_id=env_id, group_id=group_id,
        state=state, halt_at_turn=halt_at_turn,
    ))


__all__ = ["RUNNERS", "play_episode", "run_episode"]

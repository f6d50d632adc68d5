"""Branching groups: the episodes of a group share their first turns and fork at branch points.

``rollout.branching = {turns = [1, 2], width = 2}``: a group of ``group_size`` leaves starts
``group_size / width**len(turns)`` root episodes; each is played up to turn 1 (0-based: after
turn 0's env step and observation), where it forks into ``width`` children, each of which forks
again before turn 2, and every leaf plays on to the end. At a fork:

- the env forks: ``await env.afork()`` when the env has one (envs that own a live resource,
  e.g. a persistent sandbox session, fork it there: `palaestra.sandbox.SandboxSession.fork`),
  else `palaestra.envs.Env.fork` (a snapshot of the episode state, shared resources kept);
- the agent's token transcript and conversation are copied (`fork_agent`), so every leaf's
  sample holds the shared prefix's exact tokens, logprobs and versions followed by its own;
- the `EpisodeState` is copied; each child samples with its own seed (``seed_sampling``).

The engine computes the shared prefix once: the children's first requests extend the parent's
tokens, which an engine with a prefix cache (the embedded engine; SGLang's radix cache) reuses.
The last child continues with the parent's env and agent, so a fork of width ``w`` makes
``w - 1`` copies. A branch parked by a pause (weight update) continues from its tokens once the
gate reopens, whatever ``partial_rollout`` says: a tree cannot restart one branch from scratch.
A fork that fails (e.g. the sandbox cannot fork) fails the leaves below it, with the error.

Leaves are ordinary trajectories; their tree position is in the metrics: ``tree/leaf`` (the
leaf's index in the group) and ``tree/node/<k>`` (the id, unique in the group, of the node that
sampled turn ``k``; leaves that share turn ``k`` share it). An episode that ends before a branch
point stands for all the leaves below it: it is repeated, once per missing leaf, with
``tree/copy = 1`` on the repeats (so every root weighs the same in the group's statistics).
`palaestra.trainers.algorithms.tree_advantages` credits each turn with its node's value change.
"""

from __future__ import annotations

import asyncio
import copy
import math
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import Field, model_validator

from palaestra.config import Section
from palaestra.engine import SamplingParams, TokenGenerator
from palaestra.rollout.episode import EpisodeState
from palaestra.rollout.groups import Branching
from palaestra.rollout.play import run_episode
from palaestra.types import StopReason, Trajectory


class BranchingConfig(Section):
    """``[rollout.branching]``: episodes of a group share a prefix and fork at these turns."""

    turns: tuple[int, ...] = Field(min_length=1)
    """Turn indices (0-based, increasing) before which every branch forks, e.g. [1, 2]."""
    width: int = Field(2, ge=2)
    """Children per fork; group_size must be a multiple of width ** len(turns)."""

    @model_validator(mode="after")
    def _increasing(self) -> BranchingConfig:
        self.spec()
        return self

    def spec(self) -> Branching:
        return Branching(tuple(self.turns), self.width)


async def fork_env(env: Any) -> Any:
    """An independent copy of ``env`` at its current point (``afork`` if it has one)."""
    afork = getattr(env, "afork", None)
    if callable(afork):
        return await afork()
    return env.fork()


def fork_agent(agent: Any) -> Any:
    """A copy of an `Agent` mid-episode: its own conversation and token transcript, sharing the
    tokenizer and template (``agent.fork()`` when the agent class has one)."""
    own = getattr(agent, "fork", None)
    if callable(own):
        return own()
    clone = copy.copy(agent)
    clone.messages = list(agent.messages)
    clone.tools = [dict(t) for t in agent.tools]
    t = agent.transcript
    clone.transcript = replace(t, ids=list(t.ids), mask=list(t.mask), logprobs=list(t.logprobs),
                               versions=list(t.versions), turn_ends=list(t.turn_ends))
    return clone


def fork_state(st: EpisodeState) -> EpisodeState:
    return replace(st, turns=list(st.turns), halted_at=None)


@dataclass
class TreeHooks:
    """What a branching group needs from its worker: env and agent pools, the gate."""

    acquire_env: Callable[[], Any]
    release_env: Callable[[Any], None]
    acquire_agent: Callable[[], Any]
    release_agent: Callable[[Any], None]
    wait_gate: Callable[[], Awaitable[None]]  # returns once generation is allowed again
    max_aborts: int = 100
    forks: list[float] = field(default_factory=list)  # seconds per env fork (benchmarks)


@dataclass(frozen=True)
class TreeRequest:
    """One branching group to play."""

    group_id: str
    env_id: str
    task: Mapping[str, Any]
    seeds: tuple[int, ...]  # one per leaf; a root resets with its first leaf's seed
    branching: Branching
    sampling: SamplingParams
    seed_sampling: bool = True
    max_turns: int | None = None
    step_timeout_s: float | None = None


class _Tree:
    def __init__(self, request: TreeRequest, engine: TokenGenerator, hooks: TreeHooks) -> None:
        self.r, self.engine, self.hooks = request, engine, hooks
        self.next_node = 0
        self.leaves: dict[int, Trajectory] = {}

    def node_id(self) -> int:
        self.next_node += 1
        return self.next_node - 1

    def sampling(self, first_leaf: int, depth: int) -> SamplingParams:
        if not self.r.seed_sampling:
            return self.r.sampling
        seed = self.r.seeds[first_leaf]
        # the root samples with its leaf's own seed (as an independent episode would)
        return replace(self.r.sampling, seed=seed if depth == 0 else _mix(seed, depth))

    async def play(self, env: Any, agent: Any, st: EpisodeState, depth: int, first: int,
                   span: int, path: tuple[int, ...], reset_seed: int) -> None:
        r, hooks = self.r, self.hooks
        branch = r.branching
        halt = branch.turns[depth] if depth < len(branch.turns) else None
        node = self.node_id()
        start_turn = len(st.turns)
        try:
            while True:
                traj = await run_episode(
                    env, agent, self.engine, self.sampling(first, depth), seed=reset_seed,
                    task=r.task, session_id=f"{r.group_id}/{first}", max_turns=r.max_turns,
                    step_timeout_s=r.step_timeout_s, env_id=r.env_id, group_id=r.group_id,
                    state=st, halt_at_turn=halt,
                )
                if traj.stop_reason is not StopReason.ABORTED or st.halted_at is not None:
                    break
                if st.aborts > hooks.max_aborts:  # aborted by the engine itself, over and over
                    traj = replace(traj, stop_reason=StopReason.ERROR,
                                   error=f"engine: aborted {st.aborts} times in a row")
                    break
                await hooks.wait_gate()  # paused (weight update): go on from the tokens
        except BaseException:
            hooks.release_env(env)
            hooks.release_agent(agent)
            raise
        path = path + (node,) * (len(st.turns) - start_turn)
        if st.halted_at is None:  # a leaf: the episode ended (or failed)
            hooks.release_env(env)
            hooks.release_agent(agent)
            for j in range(span):
                self.leaves[first + j] = _leaf(traj, first + j, path, copy=j > 0)
            return
        children: list[Coroutine[Any, Any, None]] = []
        made: list[Any] = []
        sub = span // branch.width
        for j in range(branch.width):
            if j == branch.width - 1:
                c_env, c_agent, c_st = env, agent, st  # the last child keeps the originals
                c_st.halted_at = None
            else:
                loop = asyncio.get_running_loop()
                t = loop.time()
                try:
                    c_env = await fork_env(env)
                except Exception as exc:  # noqa: BLE001 -- fails this subtree, not the run
                    for c in children:
                        c.close()  # never started: nothing to release but the coroutine
                    for created in made:
                        hooks.release_env(created)
                    hooks.release_env(env)
                    hooks.release_agent(agent)
                    error = f"fork: {type(exc).__name__}: {exc}"
                    for k in range(span):
                        self.leaves[first + k] = _failed(r, error)
                    return
                made.append(c_env)
                hooks.forks.append(loop.time() - t)
                c_agent, c_st = fork_agent(agent), fork_state(st)
            children.append(self.play(c_env, c_agent, c_st, depth + 1, first + j * sub, sub,
                                      path, reset_seed))
        await asyncio.gather(*children)


async def play_branching_group(
    request: TreeRequest, engine: TokenGenerator, hooks: TreeHooks
) -> tuple[Trajectory, ...]:
    """Play every tree of a branching group; the leaves in index order. A root whose env or
    agent cannot be built fails its leaves (the error on each), never raises."""
    r = request
    n_roots = r.branching.roots(len(r.seeds))
    per_root = r.branching.leaves_per_root
    tree = _Tree(r, engine, hooks)

    async def root(i: int) -> None:
        first = i * per_root
        try:
            env, agent = hooks.acquire_env(), hooks.acquire_agent()
        except Exception as exc:  # noqa: BLE001 -- a bad rollout is data, not a crash
            for j in range(per_root):
                tree.leaves[first + j] = _failed(r, f"worker: {type(exc).__name__}: {exc}")
            return
        await tree.play(env, agent, EpisodeState(), 0, first, per_root, (), r.seeds[first])

    await asyncio.gather(*(root(i) for i in range(n_roots)))
    return tuple(tree.leaves[i] for i in range(len(r.seeds)))


def _leaf(traj: Trajectory, index: int, path: Sequence[int], *, copy: bool) -> Trajectory:
    tags = {"tree/leaf": float(index), **{f"tree/node/{k}": float(n) for k, n in enumerate(path)}}
    if copy:
        tags["tree/copy"] = 1.0
    samples = tuple(replace(s, metrics={**s.metrics, **tags}) for s in traj.samples)
    return replace(traj, samples=samples, metrics={**traj.metrics, **tags})


def _failed(r: TreeRequest, error: str) -> Trajectory:
    return Trajectory(env_id=r.env_id, task_id="", messages=(), turns=(), samples=(), reward=0.0,
                      stop_reason=StopReason.ERROR, error=error, group_id=r.group_id)


def _mix(seed: int, depth: int) -> int:
    from palaestra.rollout.data import _mix as mix

    return mix(seed, depth, 7)


def expected_generated_ratio(branching: Branching, turns: int) -> float:
    """Turns sampled by independent episodes over those sampled by the trees, for episodes of
    ``turns`` turns that all reach the last branch point (the benchmark's reference line)."""
    leaves = branching.leaves_per_root
    sampled, width_so_far, prev = 0, 1, 0
    for t in (*branching.turns, turns):
        t = min(t, turns)
        sampled += (t - prev) * width_so_far
        prev, width_so_far = t, width_so_far * branching.width
    return leaves * turns / max(sampled, 1) if turns else math.nan


__all__ = ["BranchingConfig", "TreeHooks", "TreeRequest", "expected_generated_ratio",
           "fork_agent", "fork_env", "fork_state", "play_branching_group"]

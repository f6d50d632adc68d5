"""`RolloutWorker`: runs hundreds of episodes as asyncio tasks; a Ray actor or an in-process object.

The manager hands a worker groups (`GroupTask`: one task, n episode seeds) and long-polls it with
`exchange`, which both submits new groups and returns the finished ones (`GroupResult`): one call
per batch of results, never one per episode. Envs come from a per-worker pool (created once per
env id and reset for each episode), agents from the agent spec, generations from the worker's
engine behind a *gate*: `pause` closes the gate and aborts the worker's in-flight requests, so
every episode stops at its next generation with stop reason ``aborted`` and is parked together
with its env, agent and tokens (the worker-local buffer); `resume` reopens the gate and restarts
the parked episodes, from their tokens (partial rollout) or from scratch.

A group whose task has ``branching`` is played as trees by one asyncio task
(`palaestra.rollout.branching.play_branching_group`). `inflight_state` (after a pause) saves the
parked groups at their episodes' last completed turns, and `restore_inflight` re-creates them in
another worker, maybe in a new process after the old one was killed
(`palaestra.rollout.inflight`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from palaestra.engine import Engine
from palaestra.rollout.config import WorkerConfig
from palaestra.rollout.episode import EpisodeState
from palaestra.rollout.gate import GatedEngine, GcTuning
from palaestra.rollout.groups import GroupResult, GroupTask, PauseReport
from palaestra.rollout.play import run_episode
from palaestra.types import StopReason, Trajectory

if TYPE_CHECKING:
    import torch

MAX_ABORTS = 100  # an episode aborted more often than this (by the engine itself) fails


@dataclass
class _Episode:
    """One episode of a group: its live state, env and agent while it runs or is parked, and its
    trajectory once it has finished."""

    state: EpisodeState | None = None
    env: Any = None
    agent: Any = None
    result: Trajectory | None = None
    running: bool = False  # an asyncio task plays it now

    @property
    def parked(self) -> bool:
        return self.result is None and self.state is not None and not self.running


class _Group:
    __slots__ = ("episodes", "task")

    def __init__(self, task: GroupTask) -> None:
        self.task = task
        self.episodes = [_Episode() for _ in task.seeds]

    @property
    def running(self) -> bool:
        return any(e.running for e in self.episodes)

    def results(self) -> tuple[Trajectory, ...] | None:
        """The trajectories in episode order once every episode has finished, else None."""
        out = tuple(e.result for e in self.episodes if e.result is not None)
        return out if len(out) == len(self.episodes) and not self.running else None


class RolloutWorker:
    """Plays groups of episodes concurrently; see the module docstring."""

    def __init__(self, config: WorkerConfig, index: int = 0, engine: Engine | None = None) -> None:
        self.index = index
        self._given_engine = engine
        self._engine: Engine | None = None
        self._rng = random.Random(index)
        self._groups: dict[str, _Group] = {}
        self._ready: list[GroupResult] = []
        self._done_tasks: dict[str, GroupTask] = {}  # the task of each group in ``_ready``
        self._wake: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._gate = GatedEngine()
        self.episodes = 0
        self._cache: Any = None
        self._gc = GcTuning()
        # bumped by `shutdown`: a long-poll still waiting from an earlier run (Ray does not cancel
        # the actor side of a call its caller abandoned) must not take the next run's results
        self._run = 0
        self._apply(config)

    def _apply(self, config: WorkerConfig) -> None:
        self.config = config
        agent = config.agent
        # the worker's rng seeds each agent's own per-episode drift draws (`Agent.start` draws)
        self._make_agent = (lambda: agent.build(self._rng)) if hasattr(agent, "build") else agent
        self._pool: dict[str, list[Any]] = {}
        self._agents: list[Any] = []  # agents are reusable: start() resets them
        if config.tool_cache is not None:
            from palaestra.rollout.tool_cache import ToolCache

            self._cache = ToolCache(*config.tool_cache)

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = self._given_engine or self.config.engine.build()
            self._gate.engine = self._engine
        return self._engine

    async def configure(self, config: WorkerConfig) -> None:
        """Start over with a new config (a finished run's worker processes serve the next one)."""
        await self.shutdown()
        self._engine = None
        self._groups.clear()
        self._ready.clear()
        self._done_tasks.clear()
        self._gate = GatedEngine()
        self._apply(config)

    async def prewarm(self, env_id: str, count: int) -> int:
        """Create ``count`` envs of ``env_id`` and agents ahead of time (pool growth otherwise
        lands in the first steps); returns the pool size."""
        while len(self._pool.get(env_id, ())) < count:
            self._release(env_id, self._acquire(env_id, fresh=True))
            await asyncio.sleep(0)
        while len(self._agents) < count:
            self._agents.append(self._make_agent())
        self._gc.freeze(self._pooled())
        return len(self._pool[env_id])

    async def warmup(self) -> int:
        """Build the engine client and one agent now (tokenizer load, imports), not in step 0."""
        self.engine  # noqa: B018
        if not self._agents:
            self._agents.append(self._make_agent())
        self._gc.freeze(self._pooled())
        return self.index

    # ----- the manager's calls ---------------------------------------------------------------
    async def exchange(
        self, groups: Sequence[GroupTask] = (), wait_s: float | None = None
    ) -> list[GroupResult]:
        """Start ``groups`` and return the groups finished so far (waiting up to ``wait_s``)."""
        self.submit(groups)
        return await self.collect(self.config.poll_s if wait_s is None else wait_s)

    def submit(self, groups: Sequence[GroupTask]) -> None:
        self.engine  # noqa: B018 -- built on the worker's own loop and process
        for task in groups:
            if task.branching is not None:
                self._start_tree(task)
                continue
            group = self._groups[task.group_id] = _Group(task)
            for i in range(len(task.seeds)):
                self._start(group, i)

    def _start_tree(self, task: GroupTask) -> None:
        task_ = asyncio.get_running_loop().create_task(self._tree(task))
        self._tasks.add(task_)
        task_.add_done_callback(self._tasks.discard)

    async def _tree(self, t: GroupTask) -> None:
        """A branching group: one asyncio task plays its trees (`play_branching_group`)."""
        from palaestra.rollout.branching import TreeHooks, TreeRequest, play_branching_group

        cfg = self.config
        assert t.branching is not None
        hooks = TreeHooks(
            acquire_env=lambda: self._acquire(t.env_id),
            release_env=lambda env: self._release(t.env_id, env),
            acquire_agent=self._acquire_agent,
            release_agent=self._agents.append,
            wait_gate=self._gate.wait_open,
            max_aborts=MAX_ABORTS,
        )
        request = TreeRequest(t.group_id, t.env_id, t.task, t.seeds, t.branching, cfg.sampling,
                              seed_sampling=cfg.seed_sampling, max_turns=cfg.max_turns,
                              step_timeout_s=cfg.step_timeout_s)
        try:
            leaves = await play_branching_group(request, self._gate, hooks)
        except Exception as exc:  # noqa: BLE001 -- e.g. a group size the trees cannot split
            leaves = tuple(_failed(t, f"worker: {type(exc).__name__}: {exc}") for _ in t.seeds)
        if cfg.rewards is not None:
            leaves = tuple([await cfg.rewards.score_trajectory(x) for x in leaves])
        self.episodes += len(leaves)
        self._ready.append(GroupResult(t.group_id, leaves, self.index))  # not in a checkpoint
        self._wake_event().set()

    async def collect(self, wait_s: float) -> list[GroupResult]:
        run = self._run
        if not self._ready and wait_s > 0:
            wake = self._wake_event()
            wake.clear()
            try:
                await asyncio.wait_for(wake.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
            else:
                if self.config.linger_s > 0:
                    await asyncio.sleep(self.config.linger_s)
        if run != self._run:  # this poll's run was shut down while it waited; its caller is gone
            return []
        ready, self._ready = self._ready, []
        for r in ready:
            self._done_tasks.pop(r.group_id, None)
        if self._pooled() > 1.25 * self._gc.frozen_objects + 64:
            self._gc.freeze(self._pooled())
        return ready

    def _pooled(self) -> int:
        return len(self._agents) + sum(len(v) for v in self._pool.values())

    async def close_gate(self) -> None:
        """Refuse new generations (episodes reaching one are parked); in-flight ones go on."""
        self._gate.open = False

    async def pause(self, abort: bool = True) -> PauseReport:
        """Stop generating: close the gate, abort this worker's requests (unless the caller
        aborted them on the engines already), wait until none is in flight."""
        await self._gate.drain(abort=abort)
        # let episodes between env step and generate reach their (refused) generation
        await asyncio.sleep(0)
        parked = [g for g in self._groups.values() if not g.running]
        return PauseReport(
            parked_groups=len(parked),
            parked_episodes=sum(e.state is not None for g in parked for e in g.episodes),
        )

    async def resume(self) -> int:
        """Reopen the gate and restart every parked episode; returns how many restarted."""
        self._gate.open = True
        restarted = 0
        for group in list(self._groups.values()):
            for i, episode in enumerate(group.episodes):
                if episode.parked:
                    self._start(group, i)
                    restarted += 1
        return restarted

    async def inflight_state(self) -> list[Any]:
        """The parked groups as `palaestra.rollout.inflight.SavedGroup`s (picklable): finished
        episodes as trajectories, parked ones at their last completed turn, and the finished
        groups no `collect` has returned yet. Call after `pause` (with the gate closed it first
        waits for episodes still inside an env step to park); the groups stay parked here (a
        checkpoint, not a hand-over). Branching groups are not in it (a tree's branches park
        inside its one task): restart those from their task."""
        from palaestra.errors import RolloutError
        from palaestra.rollout.inflight import SavedGroup, save_episode

        # with the gate closed every running episode parks at its next generation (or ends)
        for _ in range(int(self.config.step_timeout_s or 60) * 100 if not self._gate.open else 0):
            if not any(g.running for g in self._groups.values()):
                break
            await asyncio.sleep(0.01)
        if any(g.running for g in self._groups.values()):
            raise RolloutError("inflight_state: episodes are still running; pause() first")
        out = []
        for group in self._groups.values():
            live = tuple(None if e.result is not None or e.state is None or not e.state.started
                         else save_episode(e.env, e.agent, e.state) for e in group.episodes)
            out.append(SavedGroup(group.task, tuple(e.result for e in group.episodes), live))
        # finished groups no poll has collected yet: a checkpoint must not lose them either
        out.extend(SavedGroup(self._done_tasks[r.group_id], r.trajectories,
                              (None,) * len(r.trajectories))
                   for r in self._ready if r.group_id in self._done_tasks)
        return out

    async def restore_inflight(self, groups: Sequence[Any]) -> int:
        """Re-create saved groups (`inflight_state` of a worker of the same config, maybe in a
        process that died since); `resume` then plays their episodes on from their last
        completed turn (a finished group is returned by the next `collect`). Returns the
        episodes restored."""
        from palaestra.rollout.inflight import arestore_episode

        self.engine  # noqa: B018
        restored = 0
        for saved in groups:
            if all(done is not None for done in saved.finished):  # finished, not yet collected
                self._done_tasks[saved.task.group_id] = saved.task
                self._ready.append(GroupResult(saved.task.group_id, tuple(saved.finished),
                                               self.index))
                self._wake_event().set()
                continue
            group = self._groups[saved.task.group_id] = _Group(saved.task)
            for ep, done, live in zip(group.episodes, saved.finished, saved.live):
                if done is not None:
                    ep.result = done
                    continue
                ep.state = EpisodeState()  # not started: replayed from its task
                if live is not None:
                    ep.env = self._acquire(saved.task.env_id)
                    ep.agent = self._acquire_agent()
                    ep.state = await arestore_episode(live, ep.env, ep.agent)
                    restored += 1
        return restored

    async def update_weights(
        self, version: int, state_dict: Mapping[str, torch.Tensor] | None = None,
        path: str | None = None
    ) -> None:
        """Update an engine this worker owns (shared engines are updated by the manager)."""
        await self.engine.update_weights(state_dict, path=path, version=version)

    async def set_engine_urls(self, urls: Sequence[str], drain_timeout_s: float = 60.0
                              ) -> dict[str, float]:
        """The engine servers this worker routes over from now on (engines joined or left a
        running run): new URLs join its `Router`, removed ones drain out of it (their requests
        in flight finish, or after ``drain_timeout_s`` go to another engine). Returns the
        drained requests: ``finished`` and ``retried``."""
        spec = self.config.engine
        self.config = replace(self.config, engine=replace(spec, urls=tuple(urls)))
        from palaestra.engines.clients.router import Router
        from palaestra.engines.clients.sglang_client import SGLangClient

        router = self._engine
        out = {"finished": 0.0, "retried": 0.0}
        if spec.owned or not isinstance(router, Router):
            return out  # not built yet (it is built from the new list) or not a router

        kwargs = {k: v for k, v in spec.client_kwargs.items() if k != "router"}
        have = [m["name"] for m in router.status()]
        for url in urls:
            if url not in have:
                router.add_engine(SGLangClient(url, **kwargs))
        for url in (u for u in have if u not in urls):
            client = next(e for e in router.engines if getattr(e, "url", None) == url)
            result = await router.drain_engine(url, drain_timeout_s)
            out["finished"] += result["finished"]
            out["retried"] += result["retried"]
            await client.close()
        return out

    async def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "worker": self.index,
            "live_groups": len(self._groups),
            "episodes": self.episodes,
            "engine_s": self._gate.engine_s,
            "cpu_s": time.process_time(),
            "envs_pooled": sum(len(v) for v in self._pool.values()),
        }
        if self._cache is not None:
            out["tool_cache"] = self._cache.stats()
        status = getattr(self._engine, "status", None)
        if callable(status):  # a Router: per-engine health, requests served, failures
            out["engines"] = status()
            out["engine_metrics"] = self._engine.metrics()  # type: ignore[union-attr]
        return out

    async def shutdown(self) -> None:
        self._run += 1
        if self._wake is not None:  # release the waiting polls of this run now
            self._wake.set()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._engine is not None and self._given_engine is None:
            await self._engine.close()
        live = [e.env for g in self._groups.values() for e in g.episodes if e.env is not None]
        for env in [*live, *(e for envs in self._pool.values() for e in envs)]:
            env.close()
        self._pool.clear()
        self._groups.clear()
        self._gc.release()  # what was pooled for this run may now be collected
        if self._cache is not None:
            self._cache.close()
            self._cache = None

    async def ping(self) -> int:
        return self.index

    # ----- episodes --------------------------------------------------------------------------
    def _start(self, group: _Group, i: int) -> None:
        group.episodes[i].running = True
        task = asyncio.get_running_loop().create_task(self._episode(group, i))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _episode(self, group: _Group, i: int) -> None:
        t = group.task
        ep = group.episodes[i]
        cfg = self.config
        try:
            if ep.env is None:
                ep.env = self._acquire(t.env_id)
                ep.agent = self._acquire_agent()
            if ep.state is None:
                ep.state = EpisodeState()
            sampling = cfg.sampling
            if cfg.seed_sampling:
                sampling = replace(sampling, seed=t.seeds[i])
            traj = await run_episode(
                ep.env,
                ep.agent,
                self._gate,
                sampling,
                seed=t.seeds[i],
                task=t.task,
                session_id=f"{t.group_id}/{i}",
                max_turns=cfg.max_turns,
                step_timeout_s=cfg.step_timeout_s,
                env_id=t.env_id,
                group_id=t.group_id,
                state=ep.state,
            )
        except Exception as exc:  # noqa: BLE001 -- env construction or agent build failed
            traj = _failed(t, f"worker: {type(exc).__name__}: {exc}")
        if cfg.rewards is not None and traj.stop_reason is not StopReason.ABORTED:
            # [[rewards]]: scored as it finishes (still running, so resume() leaves it alone);
            # a failed score fails this episode with the reason, never raises
            traj = await cfg.rewards.score_trajectory(traj)
        ep.running = False
        if traj.stop_reason is StopReason.ABORTED:
            state = ep.state
            if state is not None and state.aborts > MAX_ABORTS:
                traj = replace(traj, stop_reason=StopReason.ERROR,
                               error=f"engine: aborted {state.aborts} times in a row")
            else:
                if state is not None and state.started and state.partial_tokens == 0 \
                        and state.requests > state.turn_requests:
                    # refused at the closed gate (or aborted before its first token): it sampled
                    # nothing, so its request index (its seed) is the next request's; where a
                    # pause lands then never changes what an episode samples
                    state.requests -= 1
                if not cfg.partial_rollout:  # restart from scratch
                    ep.state = EpisodeState()
                if self._gate.open:  # aborted by the engine itself, not by pause(): go on at once
                    self._start(group, i)
                return  # parked until resume()
        self.episodes += 1
        ep.result = traj
        self._release(t.env_id, ep.env)
        if ep.agent is not None:
            self._agents.append(ep.agent)
        ep.env = ep.agent = ep.state = None
        results = group.results()
        if results is not None:
            del self._groups[t.group_id]
            self._done_tasks[t.group_id] = t
            self._ready.append(GroupResult(t.group_id, results, self.index))
            self._wake_event().set()

    def _acquire(self, env_id: str, fresh: bool = False) -> Any:
        free = self._pool.get(env_id)
        if free and not fresh:
            return free.pop()
        from palaestra.envs import make

        env = make(env_id, **dict(self.config.env_kwargs.get(env_id, {})))
        if self._cache is not None:
            self._cache.attach(env, env_id)
        return env

    def _acquire_agent(self) -> Any:
        # a pooled agent draws this episode's drift check itself in `start`
        return self._agents.pop() if self._agents else self._make_agent()

    def _release(self, env_id: str, env: Any) -> None:
        if env is not None:
            self._pool.setdefault(env_id, []).append(env)

    def _wake_event(self) -> asyncio.Event:
        if self._wake is None:
            self._wake = asyncio.Event()
        return self._wake


def _failed(task: GroupTask, error: str) -> Trajectory:
    return Trajectory(
        env_id=task.env_id,
        task_id=task.task_id,
        messages=(),
        turns=(),
        samples=(),
        reward=0.0,
        stop_reason=StopReason.ERROR,
        error=error,
        group_id=task.group_id,
    )


__all__ = ["GroupResult", "GroupTask", "PauseReport", "RolloutWorker"]

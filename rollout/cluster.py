"""Where rollout workers run: Ray actors (default) or in-process objects (``cluster="local"``).

A `WorkerPool` owns the workers; both kinds sit behind a `WorkerClient`, whose methods have the
signatures of `RolloutWorker`'s own (awaited either way), so the manager's code is the same for
either and every call can be followed to the worker method it runs. Ray mode attaches to ``address``
(``"auto"``, ``ray://...``, or the ``RAY_ADDRESS`` that ``ray job submit`` sets) or starts a local
cluster when there is none, and shuts down only a cluster it started. Workers are async actors:
their episodes are asyncio tasks on the actor's event loop, and one actor call carries a whole
batch of groups and results. A pool outlives a manager: `configure` gives its workers a new
`WorkerConfig` (evaluation after training, or tests) without paying for new processes.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from palaestra.errors import ConfigError, MissingExtraError
from palaestra.rollout.config import WorkerConfig
from palaestra.engine import Engine
from palaestra.rollout.inflight import SavedGroup
from palaestra.rollout.groups import GroupResult, GroupTask, PauseReport
from palaestra.rollout.worker import RolloutWorker

CLUSTERS = ("ray", "local")


class WorkerClient:
    """Typed calls on one rollout worker: an in-process `RolloutWorker` or a Ray actor of one.

    Each method runs the worker method of the same name with the same arguments: directly on
    the in-process object, or as ``actor.<method>.remote(...)`` (the result awaited from its
    object ref). A dead actor surfaces as the exception Ray raises (``RayActorError``) when the
    call is awaited.
    """

    def __init__(self, index: int, local: RolloutWorker | None = None, actor: Any = None) -> None:
        if (local is None) == (actor is None):
            raise ValueError("a WorkerClient wraps either a local worker or a Ray actor handle")
        self.index = index
        self.local = local
        self.actor = actor  # a ray.actor.ActorHandle of RolloutWorker (Ray ships no stubs)

    async def warmup(self) -> int:
        if self.local is not None:
            return await self.local.warmup()
        return int(await self.actor.warmup.remote())

    async def configure(self, config: WorkerConfig) -> None:
        if self.local is not None:
            return await self.local.configure(config)
        await self.actor.configure.remote(config)

    async def prewarm(self, env_id: str, count: int) -> int:
        if self.local is not None:
            return await self.local.prewarm(env_id, count)
        return int(await self.actor.prewarm.remote(env_id, count))

    async def exchange(
        self, groups: Sequence[GroupTask] = (), wait_s: float | None = None
    ) -> list[GroupResult]:
        if self.local is not None:
            return await self.local.exchange(groups, wait_s)
        return list(await self.actor.exchange.remote(list(groups), wait_s))

    async def close_gate(self) -> None:
        if self.local is not None:
            return await self.local.close_gate()
        await self.actor.close_gate.remote()

    async def pause(self, abort: bool = True) -> PauseReport:
        if self.local is not None:
            return await self.local.pause(abort)
        report: PauseReport = await self.actor.pause.remote(abort)
        return report

    async def resume(self) -> int:
        if self.local is not None:
            return await self.local.resume()
        return int(await self.actor.resume.remote())

    async def inflight_state(self) -> list[SavedGroup]:
        if self.local is not None:
            return await self.local.inflight_state()
        return list(await self.actor.inflight_state.remote())

    async def restore_inflight(self, groups: Sequence[SavedGroup]) -> int:
        if self.local is not None:
            return await self.local.restore_inflight(groups)
        return int(await self.actor.restore_inflight.remote(list(groups)))

    async def update_weights(
        self, version: int, state_dict: Mapping[str, Any] | None = None, path: str | None = None
    ) -> None:
        if self.local is not None:
            return await self.local.update_weights(version, state_dict, path)
        await self.actor.update_weights.remote(version, state_dict, path)

    async def set_engine_urls(self, urls: Sequence[str], drain_timeout_s: float = 60.0
                              ) -> dict[str, float]:
        if self.local is not None:
            return await self.local.set_engine_urls(urls, drain_timeout_s)
        return dict(await self.actor.set_engine_urls.remote(list(urls), drain_timeout_s))

    async def stats(self) -> dict[str, Any]:
        if self.local is not None:
            return await self.local.stats()
        return dict(await self.actor.stats.remote())

    async def shutdown(self) -> None:
        if self.local is not None:
            return await self.local.shutdown()
        await self.actor.shutdown.remote()

    async def ping(self) -> int:
        if self.local is not None:
            return await self.local.ping()
        return int(await self.actor.ping.remote())


class WorkerPool:
    """``num_workers`` rollout workers, as Ray actors or in-process objects."""

    def __init__(
        self,
        worker_config: WorkerConfig,
        num_workers: int = 2,
        *,
        cluster: str = "ray",
        address: str | None = None,
        num_cpus: float = 1.0,
        engine: Engine | None = None,
        start_timeout_s: float = 60.0,
    ) -> None:
        if cluster not in CLUSTERS:
            raise ConfigError(f"cluster must be one of {CLUSTERS}, got {cluster!r}")
        if num_workers < 1:
            raise ConfigError(f"num_workers must be >= 1, got {num_workers}")
        if cluster == "ray" and engine is not None:
            raise ConfigError(
                "a live engine object cannot be shared with Ray workers; pass "
                "EngineSpec.http(urls) (engines as servers) or EngineSpec.from_factory(fn), or "
                "use cluster='local'"
            )
        self.worker_config = worker_config
        self.num_workers = num_workers
        self.cluster = cluster
        self.address = address
        self.num_cpus = num_cpus
        self.engine = engine
        self.start_timeout_s = start_timeout_s
        self.handles: list[WorkerClient] = []
        self._started_ray = False

    async def start(self) -> list[WorkerClient]:
        if self.handles:
            return self.handles
        if self.cluster == "local":
            self.handles = [
                WorkerClient(i, local=RolloutWorker(self.worker_config, i, self.engine))
                for i in range(self.num_workers)
            ]
            await asyncio.gather(*(h.warmup() for h in self.handles))
        else:
            self.handles = self._start_ray()
            await self._warmup_actors()
        return self.handles

    async def _warmup_actors(self) -> None:
        """Every actor's first call, within ``start_timeout_s``: an actor Ray cannot place
        waits forever (``PENDING_CREATION``), so one still silent then fails the pool with the
        numbers (the actors stopped) instead of hanging the run. Actors Ray placed (``ALIVE``)
        that are only slow to answer are waited for, with a line that says so."""
        from palaestra.ray_capacity import actor_states, cluster_view

        calls = [asyncio.ensure_future(h.warmup()) for h in self.handles]
        _, late = await asyncio.wait(calls, timeout=self.start_timeout_s)
        silent = [h for h, call in zip(self.handles, calls, strict=True) if call in late]
        states = sorted(set(actor_states([h.actor for h in silent])))
        if silent and states == ["ALIVE"]:  # placed, only slow to start: wait, and say so
            print(f"[rollout] {len(silent)} rollout workers placed but still starting after "
                  f"{self.start_timeout_s:g} s; waiting for them", flush=True)
            await asyncio.wait(late)
            late, silent = set(), []
        if not late:
            for call in calls:
                call.result()  # a worker that failed to start raises here
            return
        for call in late:
            call.cancel()
        cpus = cluster_view().describe("CPU")
        self._kill_actors()  # not close(): a call on a pending actor would wait for it
        raise ConfigError(
            f"{len(silent)} of {len(calls)} rollout workers ({self.num_cpus:g} CPU each) did not "
            f"start within {self.start_timeout_s:g} s (Ray: {', '.join(states)}); the cluster "
            f"has {cpus} with this run's placed actors: lower --rollout.num_workers or "
            "--rollout.worker_num_cpus, add nodes, or raise --rollout.start_timeout_s if the "
            "workers are only slow to start")

    def _start_ray(self) -> list[WorkerClient]:
        try:
            import ray
        except ImportError as exc:
            raise MissingExtraError.for_module("ray", "ray") from exc
        if not ray.is_initialized():
            # no address and no RAY_ADDRESS (set by `ray job submit`): start a local cluster
            self._started_ray = self.address is None and not os.environ.get("RAY_ADDRESS")
            kwargs: dict[str, Any] = {"include_dashboard": False}
            if self._started_ray:  # logical CPUs for every worker (Ray's default: the cores)
                need = math.ceil(self.num_workers * self.num_cpus)
                kwargs["num_cpus"] = max(os.cpu_count() or 1, need)
            ray.init(address=self.address, **kwargs)
        actor_cls = ray.remote(num_cpus=self.num_cpus)(RolloutWorker)
        return [
            WorkerClient(i, actor=actor_cls.remote(self.worker_config, i))
            for i in range(self.num_workers)
        ]

    def _kill_actors(self) -> None:
        import ray

        handles, self.handles = self.handles, []
        for h in handles:
            try:
                ray.kill(h.actor)
            except (ray.exceptions.RayError, ValueError):
                pass  # dead already
        if self._started_ray:
            ray.shutdown()

    async def configure(self, worker_config: WorkerConfig) -> None:
        """Give every worker a new config (stops whatever they were running)."""
        self.worker_config = worker_config
        if self.handles:
            await asyncio.gather(*(h.configure(worker_config) for h in self.handles))
            await asyncio.gather(*(h.warmup() for h in self.handles))

    async def prewarm(self, env_id: str, episodes: int) -> None:
        """Build envs and agents for ``episodes`` concurrent episodes, spread over the workers."""
        share = -(-episodes // max(len(self.handles), 1))
        await asyncio.gather(*(h.prewarm(env_id, share) for h in self.handles))

    async def set_engine_urls(self, urls: Sequence[str], drain_timeout_s: float = 60.0
                              ) -> dict[str, float]:
        """Every worker routes over ``urls`` from now on (`RolloutWorker.set_engine_urls`);
        the requests drained off removed engines, summed."""
        from dataclasses import replace

        wc = self.worker_config
        self.worker_config = replace(wc, engine=replace(wc.engine, urls=tuple(urls)))
        results = await asyncio.gather(*(h.set_engine_urls(urls, drain_timeout_s)
                                         for h in self.handles), return_exceptions=True)
        out = {"finished": 0.0, "retried": 0.0}
        for r in results:  # a dead worker is the manager's to notice at its next exchange
            if isinstance(r, dict):
                out["finished"] += r["finished"]
                out["retried"] += r["retried"]
        return out

    def drop(self, index: int) -> None:
        """Forget a dead worker."""
        self.handles = [h for h in self.handles if h.index != index]

    async def close(self) -> None:
        """Stop the workers (and the Ray cluster if this pool started it)."""
        handles, self.handles = self.handles, []
        await asyncio.gather(*(h.shutdown() for h in handles), return_exceptions=True)
        actors = [h.actor for h in handles if h.actor is not None]
        if actors:
            import ray

            if not ray.is_initialized():  # the cluster is gone already, and its actors with it
                return
            for actor in actors:
                try:
                    ray.kill(actor)
                except (ray.exceptions.RayError, ValueError):
                    pass  # dead already, or a handle of an earlier Ray session: nothing to stop
            if self._started_ray:
                ray.shutdown()


__all__ = ["CLUSTERS", "WorkerClient", "WorkerPool"]

"""Where rollout workers run: Ray actors (default) or in-process objects (``cluster="local"``).

A `WorkerPool` owns the workers; both kinds sit behind `WorkerHandle.call(method, *args) ->
awaitable`, so the manager's code is the same for either. Ray mode attaches to ``address``
(``"auto"``, ``ray://...``, or the ``RAY_ADDRESS`` that ``ray job submit`` sets) or starts a local
cluster when there is none, and shuts down only a cluster it started. Workers are async actors:
their episodes are asyncio tasks on the actor's event loop, and one actor call carries a whole
batch of groups and results. A pool outlives a manager: `configure` gives its workers a new
`WorkerConfig` (evaluation after training, or tests) without paying for new processes.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable
from typing import Any

from palaestra.errors import ConfigError, MissingExtraError
from palaestra.rollout.config import WorkerConfig
from palaestra.rollout.engines.base import Engine
from palaestra.rollout.worker import RolloutWorker

CLUSTERS = ("ray", "local")


class WorkerHandle:
    """A worker reached in-process or through Ray; ``call`` returns an awaitable either way."""

    def __init__(self, index: int, local: RolloutWorker | None = None, actor: Any = None) -> None:
        self.index = index
        self.local = local
        self.actor = actor

    def call(self, method: str, *args: Any) -> Awaitable[Any]:
        if self.local is not None:
            result = getattr(self.local, method)(*args)
            return result if asyncio.iscoroutine(result) else _done(result)
        return _await_ref(getattr(self.actor, method).remote(*args))


async def _done(value: Any) -> Any:
    return value


async def _await_ref(ref: Any) -> Any:
    return await ref


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
        self.handles: list[WorkerHandle] = []
        self._started_ray = False

    async def start(self) -> list[WorkerHandle]:
        if self.handles:
            return self.handles
        if self.cluster == "local":
            self.handles = [
                WorkerHandle(i, local=RolloutWorker(self.worker_config, i, self.engine))
                for i in range(self.num_workers)
            ]
        else:
            self.handles = self._start_ray()
        await asyncio.gather(*(h.call("warmup") for h in self.handles))
        return self.handles

    def _start_ray(self) -> list[WorkerHandle]:
        try:
            import ray
        except ImportError as exc:
            raise MissingExtraError.for_module("ray", "ray") from exc
        if not ray.is_initialized():
            # no address and no RAY_ADDRESS (set by `ray job submit`): start a local cluster
            self._started_ray = self.address is None and not os.environ.get("RAY_ADDRESS")
            ray.init(address=self.address, include_dashboard=False)
        actor_cls = ray.remote(num_cpus=self.num_cpus)(RolloutWorker)
        return [
            WorkerHandle(i, actor=actor_cls.remote(self.worker_config, i))
            for i in range(self.num_workers)
        ]

    async def configure(self, worker_config: WorkerConfig) -> None:
        """Give every worker a new config (stops whatever they were running)."""
        self.worker_config = worker_config
        if self.handles:
            await asyncio.gather(*(h.call("configure", worker_config) for h in self.handles))
            await asyncio.gather(*(h.call("warmup") for h in self.handles))

    async def prewarm(self, env_id: str, episodes: int) -> None:
        """Build envs and agents for ``episodes`` concurrent episodes, spread over the workers."""
        share = -(-episodes // max(len(self.handles), 1))
        await asyncio.gather(*(h.call("prewarm", env_id, share) for h in self.handles))

    def drop(self, index: int) -> None:
        """Forget a dead worker."""
        self.handles = [h for h in self.handles if h.index != index]

    async def close(self) -> None:
        """Stop the workers (and the Ray cluster if this pool started it)."""
        handles, self.handles = self.handles, []
        await asyncio.gather(*(h.call("shutdown") for h in handles), return_exceptions=True)
        actors = [h.actor for h in handles if h.actor is not None]
        if actors:
            import ray

            for actor in actors:
                ray.kill(actor)
            if self._started_ray:
                ray.shutdown()


__all__ = ["CLUSTERS", "WorkerHandle", "WorkerPool"]

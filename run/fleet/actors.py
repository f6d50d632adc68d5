"""Engines as Ray actors: one actor per engine on its bundles of the run's placement plan.

`EngineGroup.start(plan)` reserves the plan's engine bundles (`RunPlan.engine_bundles`), one Ray
placement group per engine (``STRICT_PACK``: a tensor-parallel engine's bundles on one node),
and starts one `EngineActor` per engine on its first bundle. The actor starts
the engine's HTTP server as its child process on the node of that bundle: ``palaestra serve``
(the embedded engine; CPU bundles, or one GPU) or ``python -m sglang.launch_server`` with
``--tp-size`` = the engine's bundles (``--enable-memory-saver`` and a static memory fraction
when it shares its GPUs with the trainer), and returns the server's URL once ``/health``
answers. The run then treats those URLs as it treats ``engine.urls`` servers (`ActorEngine` is
an `SGLangEngine` over them): the router, `EngineSync` and the elastic admin endpoint see
servers. A colocated plan with a trainer group (`RunPlan.shares_bundles`) starts
with ``shared=True``: one placement group of all the plan's bundles, engine i on the bundles of
trainer rank i (a fraction of each GPU, `RunPlan.engine_gpu_fraction`), kept in
`EngineGroup.placement_group` for `palaestra.trainers.group.group.TrainerGroup` to start its
ranks in. The child dies with its actor (``PR_SET_PDEATHSIG``), so a killed actor is a lost
server; `EngineGroup.close` stops the servers and kills the actors (also when the run fails).

`EngineGroup.add(gpus)` starts one more engine on ``gpus`` GPUs (0: a CPU engine) in a
placement group of its own (``palaestra engines add --gpus N``); `remove(url)` stops its server
and kills its actor. An engine over several bundles finds its GPUs' ids from a probe task on
each bundle (Ray pins an actor to the GPU of one bundle only) and pins its server to them with
``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from palaestra.engines.clients.sglang import SGLangEngine
from palaestra.errors import ConfigError, EngineError, MissingExtraError, PalaestraError
from palaestra.run.fleet.engine_actor import (
    NOSET_CUDA,
    EngineActor,
    EngineLaunch,
    EngineMember,
    gpu_ids_here,
)

if TYPE_CHECKING:
    from palaestra.run.fleet.placement import RunPlan


def ensure_ray(address: str | None, num_cpus: float) -> bool:
    """Ray initialized (attach to ``address``/``RAY_ADDRESS``, else a local cluster with at
    least ``num_cpus`` logical CPUs); True when this call started the cluster."""
    try:
        import ray
    except ImportError as exc:
        raise MissingExtraError.for_module("ray", "ray") from exc
    if ray.is_initialized():
        return False
    started = address is None and not os.environ.get("RAY_ADDRESS")
    kwargs: dict[str, Any] = {"include_dashboard": False}
    if started:
        kwargs["num_cpus"] = max(os.cpu_count() or 1, int(num_cpus + 0.999))
    ray.init(address=address, **kwargs)
    return started


class EngineGroup:
    """The engine actors of a run (see the module docstring)."""

    def __init__(self, launch: EngineLaunch, *, address: str | None = None,
                 ready_timeout_s: float = 300.0) -> None:
        self.launch = launch
        self.address = address
        self.ready_timeout_s = ready_timeout_s
        self.members: list[EngineMember] = []
        self._next = 0
        self._started_ray = False
        self._closed = False
        self.placement_group: Any = None  # shared with the trainer group (a colocated plan)

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self.members]

    def member(self, url: str) -> EngineMember | None:
        return next((m for m in self.members if m.url == url), None)

    # ------------------------------------------------------------------------ start
    async def start(self, plan: RunPlan, *, extra_cpus: float = 0.0,
                    shared: bool = False) -> list[str]:
        """Reserve the plan's engine bundles (a placement group per engine, its bundles on one
        node), start one actor per engine; their URLs. ``extra_cpus``: what else of the run
        needs logical CPUs (when the Ray cluster is started here). ``shared`` (a colocated plan,
        `RunPlan.shares_bundles`): one placement group of all the plan's bundles instead, kept
        in `placement_group` for the trainer group, engine i on its bundles in it (each actor
        asks `RunPlan.engine_gpu_fraction` of its GPU and `RunPlan.engine_cpus`)."""
        import ray

        if not plan.engine_bundles:
            raise ConfigError("the placement plan has no engine bundles (placement.engine_gpus "
                              "on GPU nodes, placement.engines on CPU nodes)")
        if shared and not plan.shares_bundles:
            raise ConfigError("a shared placement group needs a colocated plan whose engines sit "
                              "on the trainer ranks' bundles (placement.colocate = true)")
        used = (range(len(plan.bundles)) if shared
                else sorted({b for span in plan.engine_bundles for b in span}))
        need = {key: sum(plan.bundles[b].get(key, 0) for b in used) for key in ("GPU", "CPU")}
        self._started_ray = ensure_ray(self.address, need["CPU"] + extra_cpus + 1)
        try:
            self.launch = replace(self.launch, driver_ip=ray.util.get_node_ip_address())
            have = ray.cluster_resources()
            for key, n in need.items():
                if n > have.get(key, 0):
                    raise ConfigError(
                        f"the engines need {n:g} {key} ({len(plan.engine_bundles)} engines) but "
                        f"the Ray cluster has {have.get(key, 0):g}; lower "
                        "placement.engine_gpus/engines or add nodes")
            gpus = [len(span) if plan.on_gpu else 0 for span in plan.engine_bundles]
            if shared:
                await self._start_shared(plan, gpus)
            else:
                await asyncio.gather(*(self._start_one(
                    [dict(plan.bundles[b]) for b in span], plan.engine_gpu_fraction, n,
                    num_cpus=plan.engine_cpus)
                    for span, n in zip(plan.engine_bundles, gpus, strict=True)))
        except BaseException:
            await self.close()
            raise
        self.members.sort(key=lambda m: m.index)  # plan order, whichever answered first
        return self.urls

    async def _start_shared(self, plan: RunPlan, gpus: list[int]) -> None:
        """One placement group of the whole plan (the trainer group joins it later)."""
        from ray.util.placement_group import placement_group

        self.placement_group = placement_group([dict(b) for b in plan.bundles],
                                               strategy=plan.strategy)
        await self._ready(self.placement_group, f"the run's {len(plan.bundles)} bundles "
                          f"{plan.bundles[0]} ({plan.strategy})")
        await asyncio.gather(*(self._launch(
            list(span), self.placement_group, plan.bundles[span[0]], plan.engine_gpu_fraction,
            n, num_cpus=plan.engine_cpus)
            for span, n in zip(plan.engine_bundles, gpus, strict=True)))

    async def add(self, gpus: int) -> EngineMember:
        """One more engine on ``gpus`` GPUs (0: CPU) in a placement group of its own."""
        import ray

        if gpus < 0:
            raise ConfigError(f"--gpus must be >= 0 (got {gpus})")
        if not ray.is_initialized():
            raise EngineError("the run has no Ray cluster to start an engine in; start the "
                              "server yourself and `palaestra engines add URL`")
        if self.launch.driver_ip is None:
            self.launch = replace(self.launch, driver_ip=ray.util.get_node_ip_address())
        launch = self.launch
        if gpus > 1 and launch.server != "sglang":
            raise ConfigError(f"--gpus {gpus}: the embedded engine (palaestra serve) serves on "
                              "one GPU; tensor parallelism needs SGLang (engine.kind = 'sglang')")
        have = ray.available_resources()
        if gpus and have.get("GPU", 0) < gpus:
            raise EngineError(f"--gpus {gpus}: the Ray cluster has {have.get('GPU', 0):g} free "
                              "GPUs; free some or add a node")
        if gpus == 0 and launch.server == "sglang":  # SGLang needs GPUs: a CPU engine is ours
            launch = replace(launch, server="palaestra", extra_args=())
        bundles = [{"GPU": 1.0, "CPU": 1.0} for _ in range(gpus)] or [
            {"CPU": launch.cpus_per_engine}]
        return await self._start_one(bundles, 1.0 if gpus else 0.0, gpus, launch)

    async def _start_one(self, bundles: list[dict[str, float]], fraction: float, gpus: int,
                         launch: EngineLaunch | None = None, num_cpus: float | None = None
                         ) -> EngineMember:
        """A placement group of one engine's bundles (one node: STRICT_PACK) and its actor."""
        from ray.util.placement_group import placement_group, remove_placement_group

        group = placement_group(bundles, strategy="STRICT_PACK")
        try:
            await self._ready(group, f"an engine on {len(bundles)} bundle(s) {bundles[0]}")
            member = await self._launch(list(range(len(bundles))), group, bundles[0], fraction,
                                        gpus, launch=launch, num_cpus=num_cpus)
        except BaseException:
            remove_placement_group(group)
            raise
        member.placement_group = group
        return member

    async def _ready(self, group: Any, what: str) -> None:
        try:
            await asyncio.wait_for(group.ready(), self.ready_timeout_s)
        except asyncio.TimeoutError:
            from ray.util.placement_group import remove_placement_group

            if group is not self.placement_group:  # close() removes the shared one
                remove_placement_group(group)
            raise ConfigError(f"Ray could not place {what} within {self.ready_timeout_s:.0f} s "
                              "(not enough free CPUs/GPUs on one node); `ray status` shows what "
                              "is free") from None

    async def _launch(self, indices: list[int], group: Any, bundle: dict[str, float],
                      fraction: float, gpus: int, launch: EngineLaunch | None = None,
                      num_cpus: float | None = None) -> EngineMember:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        launch = launch or self.launch
        index, self._next = self._next, self._next + 1

        def on(bundle_index: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle_index)

        gpu_ids = None
        if gpus:  # every bundle's physical GPU id: the server runs over all of them
            probe = ray.remote(gpu_ids_here).options(
                num_cpus=0, num_gpus=0.01,  # beside the engine's own share of the GPU
                runtime_env={"env_vars": {NOSET_CUDA: "1"}})
            gpu_ids = [g for ids in await asyncio.gather(*(
                probe.options(scheduling_strategy=on(i)).remote() for i in indices)) for g in ids]
        if num_cpus is None:
            num_cpus = min(bundle.get("CPU", 1.0), 1.0) if not gpus else 0.5
        actor_cls: Any = ray.remote(EngineActor).options(
            num_cpus=num_cpus,
            num_gpus=fraction if gpus else 0, scheduling_strategy=on(indices[0]),
            max_restarts=0, name=None)
        actor = actor_cls.remote(launch, index, gpu_ids, gpus)
        try:
            info = await actor.start.remote()
        except BaseException as exc:  # a failed start, or the caller gave up (cancelled)
            with contextlib.suppress(Exception):
                ray.kill(actor)
            if isinstance(exc, Exception):
                raise _unwrap(exc, f"engine {index}") from exc
            raise
        member = EngineMember(index, info["url"], actor, int(info["pid"]),
                              int(info["server_pid"]), str(info["node_ip"]), gpus)
        if self._closed:  # the run ended while this engine started: it never serves
            await self._stop(member, 0.0)
            raise EngineError(f"the run ended before engine {index} could serve")
        self.members.append(member)
        print(f"[engines] engine {index} ({launch.server}, {gpus or 'no'} GPU) serves on "
              f"{member.url} (actor pid {member.pid}, node {member.node_ip})", flush=True)
        return member

    # ----------------------------------------------------------------------- stop
    async def remove(self, url: str, grace_s: float = 10.0) -> None:
        """Stop ``url``'s server, kill its actor (and its own placement group)."""
        member = self.member(url)
        if member is None:
            raise EngineError(f"{url} is not an engine this run started")
        self.members.remove(member)
        await self._stop(member, grace_s)

    async def forget(self, url: str) -> None:
        """A lost engine: kill whatever is left of its actor."""
        member = self.member(url)
        if member is not None:
            self.members.remove(member)
            await self._stop(member, 0.0)

    async def _stop(self, member: EngineMember, grace_s: float) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        with contextlib.suppress(Exception):  # dead already: nothing to stop
            await asyncio.wait_for(member.actor.stop.remote(grace_s), grace_s + 5)
        with contextlib.suppress(Exception):
            ray.kill(member.actor)
        if member.placement_group is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(member.placement_group)

    async def alive(self) -> dict[str, bool]:
        """Per engine URL: whether its actor and server still run."""
        async def one(m: EngineMember) -> bool:
            try:
                return bool(await asyncio.wait_for(m.actor.alive.remote(), 10))
            except Exception:  # noqa: BLE001 - a dead actor (RayActorError) or a hung one
                return False

        answers = await asyncio.gather(*(one(m) for m in self.members))
        return {m.url: ok for m, ok in zip(self.members, answers, strict=True)}

    async def close(self) -> None:
        """Stop every server, kill every actor, free the placement groups; idempotent."""
        if self._closed:
            return
        self._closed = True
        import ray

        members, self.members = self.members, []
        await asyncio.gather(*(self._stop(m, 5.0) for m in members))
        if self.placement_group is not None and ray.is_initialized():
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.placement_group)
            self.placement_group = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()


def _unwrap(exc: BaseException, what: str) -> PalaestraError:
    """The error an actor raised (Ray wraps it in a RayTaskError), else a clear `EngineError`."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, PalaestraError):
        return cause
    if isinstance(exc, PalaestraError):
        return exc
    return EngineError(f"{what} failed to start: {type(exc).__name__}: {exc}")


class ActorEngine(SGLangEngine):
    """An `SGLangEngine` over the servers of an `EngineGroup`; closing it stops the group."""

    def __init__(self, group: EngineGroup, **kw: Any) -> None:
        super().__init__(group.urls, **kw)
        self.actor_group = group

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            await self.actor_group.close()


def actor_group_of(engine: object) -> EngineGroup | None:
    """The engine actors behind ``engine`` (an `ActorEngine`), else None."""
    return engine.actor_group if isinstance(engine, ActorEngine) else None


__all__ = ["ActorEngine", "EngineGroup", "actor_group_of", "ensure_ray"]

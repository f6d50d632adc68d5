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
import importlib.util
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from palaestra.errors import ConfigError, EngineError, MissingExtraError, PalaestraError
from palaestra.engines.clients.sglang import SGLangEngine

if TYPE_CHECKING:
    from palaestra.run.fleet.placement import RunPlan

#: Ray lets an actor see every GPU of its node when this is set (its bundles' ids are then real)
_NOSET_CUDA = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class EngineLaunch:
    """How every engine of a group starts its server (picklable: it travels to the actors)."""

    model_path: str
    server: Literal["palaestra", "sglang"] = "palaestra"
    colocate: bool = False  # the engine shares its GPUs with trainer ranks
    extra_args: tuple[str, ...] = ()
    mem_fraction_static: float = 0.45  # SGLang, colocated: what the trainer leaves it
    startup_timeout_s: float = 600.0
    log_dir: str | None = None
    driver_ip: str | None = None  # servers on the driver's node bind to loopback
    cpus_per_engine: float = 1.0  # an added CPU engine's actor (plan engines: their bundles')


def server_argv(launch: EngineLaunch, *, host: str, port: int, gpus: int) -> list[str]:
    """The command line of one engine's server on ``gpus`` GPUs (0: CPU, ``palaestra serve``)."""
    if launch.server == "sglang":  # SGLang's documented CLI (python -m sglang.launch_server)
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", launch.model_path,
               "--tp-size", str(max(gpus, 1)), "--host", host, "--port", str(port)]
        if launch.colocate:  # it frees its memory while the trainer trains
            cmd.append("--enable-memory-saver")
            if "--mem-fraction-static" not in launch.extra_args:
                cmd += ["--mem-fraction-static", str(launch.mem_fraction_static)]
        return cmd + list(launch.extra_args)
    from palaestra.engines.serve.serve import serve_argv

    return serve_argv(launch.model_path, port=port, host=host,
                      device="cuda" if gpus else "cpu", extra=launch.extra_args)


def _die_with_parent() -> None:
    """In the server's process before exec: SIGKILL it when the actor's thread that started it
    ends (the actor killed or crashed), so a server never outlives its actor: a dead actor is a
    lost server (SGLang's own subprocesses die with their launcher the same way)."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class EngineActor:
    """The Ray actor of one engine: starts its server as a child process and watches it."""

    def __init__(self, launch: EngineLaunch, index: int, gpu_ids: list[int] | None = None,
                 gpus: int = 0) -> None:
        self.launch = launch
        self.index = index
        self.gpu_ids = gpu_ids
        self.gpus = gpus
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    def start(self) -> dict[str, Any]:
        """Start the server; its URL (and pids, node) once ``/health`` answers."""
        import ray

        from palaestra.engines.weights.weight_transfer import free_port

        launch = self.launch
        if launch.server == "sglang" and importlib.util.find_spec("sglang") is None:
            raise MissingExtraError.for_module("sglang", "sglang")
        node_ip = ray.util.get_node_ip_address()
        host = "127.0.0.1" if node_ip == launch.driver_ip else node_ip
        port = free_port()
        self.url = f"http://{host}:{port}"
        argv = server_argv(launch, host=host, port=port, gpus=self.gpus)
        env = dict(os.environ)
        env.pop(_NOSET_CUDA, None)
        if self.gpu_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpu_ids)
        log: Any = subprocess.DEVNULL
        if launch.log_dir:
            Path(launch.log_dir).mkdir(parents=True, exist_ok=True)
            self.log_path = Path(launch.log_dir) / f"engine-{self.index}-{port}.log"
            log = open(self.log_path, "ab")  # noqa: SIM115 - the child writes it as long as it runs
        # preexec_fn only calls prctl (async-signal-safe enough); the actor starts one child
        self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     preexec_fn=_die_with_parent)  # noqa: PLW1509
        deadline = time.monotonic() + launch.startup_timeout_s
        while not self._answers():
            if self.proc.poll() is not None:
                raise EngineError(f"engine {self.index}: {' '.join(argv[:5])} ... exited with "
                                  f"code {self.proc.returncode} before answering on {self.url}; "
                                  f"log tail:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise EngineError(f"engine {self.index} did not answer on {self.url} within "
                                  f"{launch.startup_timeout_s:.0f} s; log tail:\n{self.log_tail()}")
            time.sleep(0.2)
        return {"url": self.url, "pid": os.getpid(), "server_pid": self.proc.pid,
                "node_ip": node_ip, "gpu_ids": self.gpu_ids}

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return bool(200 <= r.status < 300)
        except OSError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 3000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log: set the launch's log_dir)"
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the server's process group (the server drains), SIGKILL after ``grace_s``."""
        if self.proc is not None:
            from palaestra.processes import terminate_process_group

            terminate_process_group(self.proc, grace_s)


def _gpu_ids() -> list[int]:
    """(A probe task on one bundle) the physical GPU ids Ray gave it."""
    import ray

    return [int(g) for g in ray.get_gpu_ids()]


@dataclass
class EngineMember:
    """One started engine: its actor, URL, processes and (for an added one) its own group."""

    index: int
    url: str
    actor: Any
    pid: int
    server_pid: int
    node_ip: str
    gpus: int
    placement_group: Any = None  # the engine's own placement group (removed with it)

    def describe(self) -> dict[str, Any]:
        return {"index": self.index, "url": self.url, "actor_pid": self.pid,
                "server_pid": self.server_pid, "node": self.node_ip, "gpus": self.gpus}


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
            probe = ray.remote(_gpu_ids).options(
                num_cpus=0, num_gpus=0.01,  # beside the engine's own share of the GPU
                runtime_env={"env_vars": {_NOSET_CUDA: "1"}})
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


__all__ = ["ActorEngine", "EngineActor", "EngineGroup", "EngineLaunch", "EngineMember",
           "actor_group_of", "ensure_ray", "server_argv"]

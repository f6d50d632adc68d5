"""Weights from the training backend to the rollout engines after every step, by one path.

`EngineSync.from_config` picks the path of ``[engine.weight_sync]``: the embedded engine's
tensors overwritten in process; SGLang servers through a weight-update group (NCCL or gloo
broadcast), CUDA IPC handles (``ipc``: servers colocated on this host's GPU map the trainer's
memory, bucket by bucket), through disk, or base64 tensors over HTTP.
`EngineSync.weights_of(backend)` is the `WeightPush` the rollout manager runs between pausing
and resuming generation; `last` holds the timing of the newest push (logged as ``sync/*``).
`palaestra.run.weight_pushes.choose_push` picks one push class per backend at its first push,
from typed capabilities.

A trainer group pushing to servers (`palaestra.trainers.group.push.PushesOwnWeights`) sends the
weights from its rank 0 itself: `EngineSync` gives it the path (`push_spec`: the method, the
servers' URLs, the rendezvous or folder) and reads the servers' weight versions back afterwards;
the tensors never reach this process. The embedded engine lives in this process, so a group
feeding it still brings the weights here.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard, cast

from palaestra.contracts import AdapterSettings, AdapterTrainer
from palaestra.engine import AdapterServing
from palaestra.errors import ConfigError
from palaestra.run.weight_pushes import SyncPush, choose_push

if TYPE_CHECKING:
    from palaestra.contracts import WeightSource
    from palaestra.engine import Engine
    from palaestra.engines import LocalEngine
    from palaestra.engines.clients.sglang import SGLangClient, SGLangEngine
    from palaestra.engines.weights.weight_transfer import TransferStats
    from palaestra.run.config import EngineSection
    from palaestra.trainers.group.push import EnginePushSpec, PushesOwnWeights


def resolve_method(engine: EngineSection, *, colocate: bool = False) -> str:
    """The concrete path of ``engine.weight_sync``: ``auto`` is decided by engine kind, CUDA and
    placement: ``ipc`` for servers colocated with the trainer (``[placement] colocate``) on this
    host's GPU (their URLs are this host's), else ``distributed`` on CUDA, else ``disk``."""
    method: str = engine.weight_sync.kind
    if method != "auto":
        return method
    if engine.kind == "local":
        return "in_process"
    import torch

    from palaestra.engines.weights.weight_transfer import on_this_host

    if not torch.cuda.is_available():
        return "disk"
    if colocate and all(on_this_host(u) for u in engine.urls):  # launched servers are local
        return "ipc"
    return "distributed"


def _servers(engine: LocalEngine | SGLangEngine, method: str) -> list[SGLangClient]:
    """The server clients a sender of ``method`` pushes to (SGLang servers only)."""
    from palaestra.engines.clients.sglang import SGLangEngine

    if not isinstance(engine, SGLangEngine):
        raise ConfigError(f"engine.weight_sync.kind = {method!r} needs SGLang servers "
                          "(engine.kind = 'sglang'); the embedded engine is updated in process")
    return engine.clients  # the engine's own list (the senders see engines that join)


class EngineSync:
    """One sync path, its sender (for SGLang servers) and the timing of the last push."""

    def __init__(self, method: str, engine: Engine, *, sender: Any = None, bucket_bytes: int,
                 dtype: Any = None, device: str = "cpu") -> None:
        self.method = method
        self.engine = engine
        self.sender = sender
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self.device = device
        self.last: TransferStats | None = None
        # LoRA to SGLang servers: the adapter as a peft folder here, loaded by the servers over
        # /load_lora_adapter and named in every request of this process's engine (the run's
        # loop sets it when the rollout is in process; Ray workers' own clients would not name
        # it, so they get the merged weights by the configured path instead)
        self.lora_servers = False
        self.adapter_dir: Path | None = None
        self._served_adapter: tuple[str, Path] | None = None
        self.group_pushes = 0  # pushes a trainer group's rank 0 made itself (no relay here)
        self._unflushed_remote: int | None = None
        # the path of each backend, chosen at its first push (the backend is built after this)
        self._paths: dict[int, tuple[WeightSource, SyncPush]] = {}

    @classmethod
    def from_config(cls, settings: EngineSection, engine: LocalEngine | SGLangEngine,
                    policy_path: Path, *, out: str, colocate: bool = False) -> EngineSync:
        """The sync of ``[engine]`` (``settings``) to ``engine``; ``out``: the run directory
        (``{out}`` in ``weight_sync.dir``); ``colocate``: ``[placement] colocate`` (auto may
        pick ``ipc``)."""
        import torch

        from palaestra.engines.weights.weight_transfer import (
            DiskWeightSender,
            DistributedWeightSender,
            IpcWeightSender,
        )
        from palaestra.run.config import DiskSync, DistributedSync, IpcSync

        method = resolve_method(settings, colocate=colocate)
        e = settings.sync_settings(method)
        dtype = getattr(torch, e.dtype) if e.dtype else None
        sender: Any = None
        device = "cpu"
        bucket_mb = 512  # the in-process and tensor paths move the weights whole
        if isinstance(e, DistributedSync):
            if e.backend == "nccl" and not torch.cuda.is_available():
                raise ConfigError("engine.weight_sync.backend = 'nccl' needs CUDA here; use "
                                  "'gloo' or engine.weight_sync.kind = 'disk'")
            sender = DistributedWeightSender(
                _servers(engine, method), backend=e.backend, master_address=e.master_address,
                master_port=e.master_port, timeout_s=e.timeout_s)
            if e.backend == "nccl":  # a CUDA snapshot of the weights: no host round trip
                device = "cuda"
            bucket_mb = e.bucket_mb
        elif isinstance(e, DiskSync):
            sender = DiskWeightSender(_servers(engine, method), e.dir.replace("{out}", out),
                                      model_dir=policy_path, keep_last=2)
            bucket_mb = e.bucket_mb
        elif isinstance(e, IpcSync):  # handles of the trainer's own (CUDA) tensors, bucketed
            sender = IpcWeightSender(_servers(engine, method), timeout_s=e.timeout_s)
            device = "cuda" if torch.cuda.is_available() else "cpu"
            bucket_mb = e.bucket_mb
        sync = cls(method, engine, sender=sender, bucket_bytes=bucket_mb << 20,
                   dtype=dtype, device=device)
        sync.adapter_dir = Path(out) / "lora-sync"
        return sync

    def weights_of(self, backend: WeightSource) -> BackendWeights:
        """``backend``'s weights as a `WeightPush`, for `RolloutManager.update_weights`."""
        return BackendWeights(self, backend)

    async def push_now(self, backend: WeightSource, version: int) -> TransferStats:
        """Move the weights now (generation should be paused) and time it, by the path
        `choose_push` picked for ``backend`` at its first push."""
        entry = self._paths.get(id(backend))
        if entry is None or entry[0] is not backend:
            entry = (backend, choose_push(self, backend))
            self._paths[id(backend)] = entry
        self.last = await entry[1].push(backend, version)
        return self.last

    def _pushes_itself(self, backend: object) -> TypeGuard[PushesOwnWeights]:
        """Whether ``backend`` (a trainer group) sends the weights to the servers itself."""
        from palaestra.trainers.group.push import REMOTE_METHODS, PushesOwnWeights

        return isinstance(backend, PushesOwnWeights) and self.method in REMOTE_METHODS

    def _server_clients(self) -> list[Any]:
        return list(self.sender.clients) if self.sender is not None \
            else list(_servers(self.engine, self.method))  # type: ignore[arg-type]

    def push_spec(self) -> EnginePushSpec:
        """This sync's path as a trainer group's rank 0 takes it (see the module doc)."""
        from palaestra.engines.weights.weight_transfer import (
            DiskWeightSender,
            DistributedWeightSender,
            IpcWeightSender,
        )
        from palaestra.trainers.group.push import EnginePushSpec

        clients = self._server_clients()
        kw: dict[str, Any] = {}
        s = self.sender
        if isinstance(s, DistributedWeightSender):
            kw = {"backend": s.backend, "master_address": s.master_address,
                  "master_port": s.master_port, "timeout_s": s.timeout_s}
        elif isinstance(s, DiskWeightSender):
            kw = {"directory": str(s.directory),
                  "model_dir": None if s.model_dir is None else str(s.model_dir)}
        elif isinstance(s, IpcWeightSender):  # a sender must share its server's host and GPU
            kw = {"timeout_s": s.timeout_s, "rank_urls": _neighbour_urls(self.engine),
                  "tp_sizes": tuple(int(getattr(c, "tp_size", 1)) for c in clients)}
        else:
            kw = {"tp_sizes": tuple(int(getattr(c, "tp_size", 1)) for c in clients)}
        return EnginePushSpec(
            method=self.method, urls=tuple(c.url for c in clients),
            bucket_bytes=self.bucket_bytes,
            dtype=None if self.dtype is None else str(self.dtype).removeprefix("torch."), **kw)

    async def push_from_group(self, backend: PushesOwnWeights, version: int,
                              client: SGLangClient | None = None) -> TransferStats:
        """Rank 0 of ``backend`` pushes ``version`` (to ``client`` alone: a joining server);
        then the servers' versions are read back."""
        from palaestra.engines.weights.weight_transfer import DistributedWeightSender

        if isinstance(self.sender, DistributedWeightSender):
            await self.sender.close()  # one weight-update group at a time (a fixed port)
        spec = self.push_spec()
        if client is not None:
            spec = spec.only(client.url, int(getattr(client, "tp_size", 1)))
        stats: TransferStats = await asyncio.to_thread(
            backend.push_weights, spec, version, keep=client is None)
        if client is None:
            self.group_pushes += 1
            last = getattr(backend, "last_push", None) or {}
            self._unflushed_remote = last.get("unflushed")
        clients = [client] if client is not None else self._server_clients()
        await asyncio.gather(*(c.get_model_info() for c in clients))  # their weight_version
        return stats

    async def push_adapter_to_servers(self, backend: AdapterTrainer, version: int
                                      ) -> TransferStats:
        """Write the adapter as a peft folder, have every server load it under a versioned
        name (SGLang refuses to reload a loaded name), make it the engine's default adapter
        and unload the previous version. The servers must see this machine's disk."""
        import shutil

        from palaestra.engines.weights.weight_transfer import TransferStats

        engine = self.engine
        if self.adapter_dir is None or not isinstance(engine, AdapterServing):
            raise ConfigError("LoRA to servers needs an engine with /load_lora_adapter "
                              "(SGLangEngine) and a run directory (EngineSync.from_config)")
        start = time.perf_counter()
        lora = cast(AdapterSettings, backend.lora)  # set: only an adapter push gets here
        name = f"{lora.adapter_name}-v{version}"
        folder = backend.export_adapter(self.adapter_dir / name)
        await engine.load_lora_adapter(name, str(folder))
        old, self._served_adapter = self._served_adapter, (name, folder)
        engine.default_lora = name
        if old is not None and old[0] != name:
            await engine.unload_lora_adapter(old[0])
            shutil.rmtree(old[1], ignore_errors=True)
        size = sum(f.stat().st_size for f in folder.iterdir() if f.suffix == ".safetensors")
        return TransferStats(time.perf_counter() - start, size, 1, 1)

    async def push_checkpoint(self, path: Path, version: int) -> None:
        """Load a Hugging Face checkpoint folder into the engines (e.g. the warm-started policy):
        by path for the embedded engine, through the sender for servers, which may not see
        this machine's disk."""
        from palaestra.engines.local.model import iter_safetensors, safetensors_files
        from palaestra.engines.weights.weight_transfer import bucketize

        if self.sender is None:
            await self.engine.update_weights(path=str(path), version=version)
            return
        named = iter_safetensors(safetensors_files(path))
        if self.dtype is not None:
            named = ((n, t.to(self.dtype) if t.is_floating_point() else t) for n, t in named)
        self.last = await self.sender.push(bucketize(named, self.bucket_bytes), version)

    async def push_to(self, client: Any, backend: WeightSource, version: int) -> TransferStats:
        """The current weights to one more server only (an engine joining a running run), by
        the run's path: a weight-update group of that server alone, a disk version, or HTTP
        tensors. The run's own sender is not touched (see `set_clients`)."""
        from palaestra.engines.weights.weight_transfer import (
            DiskWeightSender,
            DistributedWeightSender,
            IpcWeightSender,
            TransferStats,
        )

        if self._pushes_itself(backend):  # a trainer group: from its rank 0
            return await self.push_from_group(backend, version, client=client)
        s = self.sender
        if isinstance(s, DistributedWeightSender):
            one: Any = DistributedWeightSender(
                [client], backend=s.backend, master_address=s.master_address, master_port=0,
                timeout_s=s.timeout_s, device=s.device)
        elif isinstance(s, DiskWeightSender):
            one = DiskWeightSender([client], s.directory, model_dir=s.model_dir,
                                   keep_last=s.keep_last)
        elif isinstance(s, IpcWeightSender):
            one = IpcWeightSender([client], timeout_s=s.timeout_s)
        elif s is None and self.method == "tensor":
            start = time.perf_counter()
            weights = backend.state_dict_for_engines(dtype=self.dtype, device="cpu")
            await client.update_weights(weights, version=version)
            unique = {t.data_ptr(): t for t in weights.values()}.values()
            return TransferStats(time.perf_counter() - start,
                                 sum(t.numel() * t.element_size() for t in unique),
                                 len(weights), 1)
        else:
            raise ConfigError(f"engine.weight_sync {self.method!r} cannot reach a server that "
                              "joins a running run; engines join runs with engine.kind = "
                              "'sglang' (weight_sync distributed, ipc, disk or tensor)")
        try:
            await one.connect()
            return await one.push(backend.iter_engine_weight_buckets(
                self.bucket_bytes, dtype=self.dtype, device=self.device), version)  # type: ignore[no-any-return]
        finally:
            await one.close()

    async def set_clients(self, clients: list[Any]) -> None:
        """The servers later pushes go to (engines joined or left the run). A weight-update
        group is torn down and forms again over them at the next push."""
        from palaestra.engines.weights.weight_transfer import DistributedWeightSender

        if self.sender is None:
            return
        if isinstance(self.sender, DistributedWeightSender):
            await self.sender.close()
        self.sender.clients = list(clients)

    def metrics(self) -> dict[str, float]:
        """``sync/*`` of the last push (empty before the first), with the servers that declined
        to flush their prefix cache afterwards (their cached prefixes predate the weights)."""
        if self.last is None:
            return {}
        out = self.last.as_metrics()
        if self._unflushed_remote is not None:
            out["sync/unflushed_servers"] = float(self._unflushed_remote)
        elif self.sender is not None and hasattr(self.sender, "unflushed"):
            out["sync/unflushed_servers"] = float(self.sender.unflushed)
        return out

    async def close(self) -> None:
        """Tear down the sender's weight-update group (nothing for the other paths)."""
        if self.sender is not None:
            await self.sender.close()


@dataclass(frozen=True)
class BackendWeights:
    """A `palaestra.engines.weights.push.WeightPush`: the training backend's current weights
    through the run's sync path."""

    sync: EngineSync
    backend: WeightSource

    async def push(self, version: int) -> None:
        await self.sync.push_now(self.backend, version)


def _neighbour_urls(engine: Any) -> tuple[str, ...]:
    """The server beside each trainer rank, by rank, when the run's engine actors share the
    trainer group's bundles (engine i on rank i's GPU, one GPU each); else ()."""
    group = getattr(engine, "actor_group", None)
    if group is None or getattr(group, "placement_group", None) is None:
        return ()
    shared = sorted((m for m in group.members if m.placement_group is None and m.gpus <= 1),
                    key=lambda m: m.index)
    return tuple(m.url for m in shared)


__all__ = [
    "BackendWeights",
    "EngineSync",
    "resolve_method",
]

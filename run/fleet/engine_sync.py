"""The path of the weights from the training backend to the rollout engines, by one path.

`EngineSync.from_config` picks the path of ``[engine.weight_sync]``: the embedded engine's
tensors overwritten in process; SGLang servers through a weight-update group (NCCL or gloo
broadcast), CUDA IPC handles (``ipc``: servers colocated on this host's GPU map the trainer's
memory, bucket by bucket), through disk, or base64 tensors over HTTP. The push itself is one
class per path (`palaestra.run.fleet.weight_pushes.build_push`, built once per run from typed
capabilities); `EngineSync` holds what they share: the sender, the bucket size, the dtype.

A trainer group pushing to servers (`palaestra.trainers.group.push.PushesOwnWeights`) sends the
weights from its rank 0 itself: `EngineSync` gives it the path (`push_spec`: the method, the
servers' URLs, the rendezvous or folder); the tensors never reach this process. The embedded
engine lives in this process, so a group feeding it still brings the weights here.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from palaestra.engine import OnDevice
from palaestra.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from palaestra.contracts import WeightSource
    from palaestra.engine import Engine
    from palaestra.engines.local.local import LocalEngine
    from palaestra.engines.clients.sglang import SGLangEngine
    from palaestra.engines.clients.sglang_client import SGLangClient
    from palaestra.engines.weights.weight_transfer import TransferStats
    from palaestra.run.sections import EngineSection
    from palaestra.run.fleet.actors import EngineGroup
    from palaestra.trainers.group.push import EnginePushSpec


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
    """One sync path: its sender (for SGLang servers), bucket size and dtype, and where LoRA
    adapters go (``lora_servers``, ``adapter_dir``)."""

    def __init__(self, method: str, engine: Engine, *, sender: Any = None, bucket_bytes: int,
                 dtype: torch.dtype | None = None, device: str = "cpu", lora_servers: bool = False,
                 adapter_dir: Path | None = None) -> None:
        self.method = method
        self.engine = engine
        self.sender = sender
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self.device = device
        # the embedded engine's device and compute dtype (servers: host memory, their own)
        self.engine_device: Any = engine.device if isinstance(engine, OnDevice) else "cpu"
        self.engine_dtype: Any = engine.dtype if isinstance(engine, OnDevice) else None
        # LoRA to SGLang servers: the adapter as a peft folder in ``adapter_dir``, loaded by the
        # servers over /load_lora_adapter and named in every request of this process's engine
        # (when the rollout is in process; Ray workers' own clients would not name it, so they
        # get the merged weights by the configured path instead)
        self.lora_servers = lora_servers
        self.adapter_dir = adapter_dir

    @classmethod
    def from_config(cls, settings: EngineSection, engine: LocalEngine | SGLangEngine,
                    policy_path: Path, *, out: str, colocate: bool = False,
                    lora_servers: bool = False) -> EngineSync:
        """The sync of ``[engine]`` (``settings``) to ``engine``; ``out``: the run directory
        (``{out}`` in ``weight_sync.dir``); ``colocate``: ``[placement] colocate`` (auto may
        pick ``ipc``); ``lora_servers``: LoRA adapters to SGLang servers by name (the rollout
        runs in this process)."""
        import torch

        from palaestra.engines.weights.disk_sender import DiskWeightSender
        from palaestra.engines.weights.weight_transfer import (
            DistributedWeightSender,
            IpcWeightSender,
        )
        from palaestra.run.fleet.sync_settings import DiskSync, DistributedSync, IpcSync

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
        return cls(method, engine, sender=sender, bucket_bytes=bucket_mb << 20, dtype=dtype,
                   device=device, lora_servers=lora_servers, adapter_dir=Path(out) / "lora-sync")

    def server_clients(self) -> list[SGLangClient]:
        """The servers the pushes go to now."""
        return list(self.sender.clients) if self.sender is not None \
            else list(_servers(self.engine, self.method))  # type: ignore[arg-type]

    def push_spec(self) -> EnginePushSpec:
        """This sync's path as a trainer group's rank 0 takes it (see the module doc)."""
        from palaestra.engines.weights.disk_sender import DiskWeightSender
        from palaestra.engines.weights.weight_transfer import (
            DistributedWeightSender,
            IpcWeightSender,
        )
        from palaestra.run.fleet.actors import actor_group_of
        from palaestra.trainers.group.push import EnginePushSpec

        clients = self.server_clients()
        kw: dict[str, Any] = {}
        s = self.sender
        if isinstance(s, DistributedWeightSender):
            kw = {"backend": s.backend, "master_address": s.master_address,
                  "master_port": s.master_port, "timeout_s": s.timeout_s}
        elif isinstance(s, DiskWeightSender):
            kw = {"directory": str(s.directory),
                  "model_dir": None if s.model_dir is None else str(s.model_dir)}
        elif isinstance(s, IpcWeightSender):  # a sender must share its server's host and GPU
            kw = {"timeout_s": s.timeout_s, "rank_urls": _neighbour_urls(actor_group_of(self.engine)),
                  "tp_sizes": tuple(c.tp_size for c in clients)}
        else:
            kw = {"tp_sizes": tuple(c.tp_size for c in clients)}
        return EnginePushSpec(
            method=self.method, urls=tuple(c.url for c in clients),
            bucket_bytes=self.bucket_bytes,
            dtype=None if self.dtype is None else str(self.dtype).removeprefix("torch."), **kw)

    async def push_checkpoint(self, path: Path, version: int) -> None:
        """Load a Hugging Face checkpoint folder into the engines (e.g. the warm-started policy):
        by path for the embedded engine, through the sender for servers, which may not see
        this machine's disk."""
        from palaestra.engines.weights.checkpoint_files import iter_safetensors, safetensors_files
        from palaestra.engines.weights.weight_transfer import bucketize

        if self.sender is None:
            await self.engine.update_weights(path=str(path), version=version)
            return
        named = iter_safetensors(safetensors_files(path))
        if self.dtype is not None:
            named = ((n, t.to(self.dtype) if t.is_floating_point() else t) for n, t in named)
        await self.sender.push(bucketize(named, self.bucket_bytes), version)

    async def push_to(self, client: SGLangClient, backend: WeightSource, version: int
                      ) -> TransferStats:
        """The current weights to one more server only (an engine joining a running run), by
        the run's path: a weight-update group of that server alone, a disk version, or HTTP
        tensors. The run's own sender is not touched (see `set_clients`); a trainer group
        sends from its rank 0 (`palaestra.run.fleet.weight_pushes.push_to_joining`)."""
        from palaestra.engines.weights.disk_sender import DiskWeightSender
        from palaestra.engines.weights.weight_transfer import (
            DistributedWeightSender,
            IpcWeightSender,
            TransferStats,
        )

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

    async def close(self) -> None:
        """Tear down the sender's weight-update group (nothing for the other paths)."""
        if self.sender is not None:
            await self.sender.close()


def _neighbour_urls(group: EngineGroup | None) -> tuple[str, ...]:
    """The server beside each trainer rank, by rank, when the run's engine actors (``group``)
    share the trainer group's bundles (engine i on rank i's GPU, one GPU each); else ()."""
    if group is None or group.placement_group is None:
        return ()
    shared = sorted((m for m in group.members if m.placement_group is None and m.gpus <= 1),
                    key=lambda m: m.index)
    return tuple(m.url for m in shared)


__all__ = [
    "EngineSync",
    "resolve_method",
]

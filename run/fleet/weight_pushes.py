"""The push classes of the weight sync: one class per way the weights of a backend reach the
engines, built once per run by `build_push` from typed capabilities (the backend's:
`palaestra.contracts.AdapterTrainer` with ``lora`` set, a trainer group that `PushesOwnWeights`;
the engine's: `palaestra.engine.AdapterHost`) instead of probing attributes at every push.

- `AdapterToServersPush`: a LoRA adapter to SGLang servers, as a peft folder they load by name;
- `GroupPush`: a trainer group's rank 0 sends the weights itself;
- `SenderPush`: buckets through the path's sender (NCCL/gloo broadcast, disk, CUDA IPC);
- `AdapterInProcessPush`: the adapter alone into the embedded engine;
- `WholeWeightsPush`: the whole state dict through ``update_weights`` (in process, or HTTP
  tensors to servers).

Each push holds its backend, the path it reads (`EngineSync`) and its own state (the adapter the
servers serve, the servers that kept their cache); the loop calls ``push(version)`` while the
rollout manager holds generation paused (`RolloutManager.weights_paused`), and the weights go
forward from the backend to the engines: nothing calls back into the loop.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Protocol, cast

from palaestra.contracts import AdapterSettings, AdapterTrainer, WeightSource, trains_adapter
from palaestra.engine import AdapterHost, AdapterServing
from palaestra.errors import ConfigError

if TYPE_CHECKING:
    from pathlib import Path

    from palaestra.engines.clients.sglang_client import SGLangClient
    from palaestra.engines.weights.weight_transfer import TransferStats
    from palaestra.run.fleet.engine_sync import EngineSync


class SyncPush(Protocol):
    """The weights of one backend to the engines by one path (one class per path)."""

    @property
    def sync(self) -> EngineSync:
        """The run's path (sender, bucket size, dtype) this push reads."""
        ...

    @property
    def backend(self) -> WeightSource:
        """Where the weights come from."""
        ...

    async def push(self, version: int) -> TransferStats:
        """Put the backend's current weights on every engine as ``version`` (generation is
        paused meanwhile, unless the engine swaps weights between decode steps)."""
        ...

    def metrics(self) -> dict[str, float]:
        """``sync/*`` of the last push (empty before the first)."""
        ...


class _Timed:
    """The timing of the last push, logged as ``sync/*``."""

    last: TransferStats | None = None

    def metrics(self) -> dict[str, float]:
        return {} if self.last is None else self.last.as_metrics()


class AdapterToServersPush(_Timed):
    """A LoRA backend's adapter to SGLang servers: a peft folder they load under a versioned
    name (SGLang refuses to reload a loaded name), made the engine's default adapter, the
    previous version unloaded. The servers must see this machine's disk."""

    def __init__(self, sync: EngineSync, backend: WeightSource, engine: AdapterServing,
                 adapter_dir: Path) -> None:
        self.sync, self.backend, self.engine, self.adapter_dir = sync, backend, engine, adapter_dir
        self.trainer = cast(AdapterTrainer, backend)  # build_push checked it
        self._served: tuple[str, Path] | None = None  # the adapter the servers serve now

    async def push(self, version: int) -> TransferStats:
        import shutil

        from palaestra.engines.weights.weight_transfer import TransferStats

        start = time.perf_counter()
        lora = cast(AdapterSettings, self.trainer.lora)  # set: build_push checked it
        name = f"{lora.adapter_name}-v{version}"
        folder = self.trainer.export_adapter(self.adapter_dir / name)
        await self.engine.load_lora_adapter(name, str(folder))
        old, self._served = self._served, (name, folder)
        self.engine.default_lora = name
        if old is not None and old[0] != name:
            await self.engine.unload_lora_adapter(old[0])
            shutil.rmtree(old[1], ignore_errors=True)
        size = sum(f.stat().st_size for f in folder.iterdir() if f.suffix == ".safetensors")
        self.last = TransferStats(time.perf_counter() - start, size, 1, 1)
        return self.last


class GroupPush(_Timed):
    """A trainer group's rank 0 sends the weights to the servers itself (the tensors never
    reach this process); then the servers' weight versions are read back."""

    def __init__(self, sync: EngineSync, backend: WeightSource) -> None:
        from palaestra.trainers.group.push import PushesOwnWeights

        assert isinstance(backend, PushesOwnWeights)  # build_push checked it
        self.sync, self.backend, self.group = sync, backend, backend
        self.pushes = 0  # pushes rank 0 made itself (no relay through this process)
        self._unflushed: int | None = None  # servers that kept their prefix cache

    async def push(self, version: int) -> TransferStats:
        self.last = await self.push_to(version)
        self.pushes += 1
        last = self.group.last_push or {}
        self._unflushed = last.get("unflushed")
        return self.last

    async def push_to(self, version: int, client: SGLangClient | None = None) -> TransferStats:
        """Rank 0 pushes ``version`` (to ``client`` alone: a server joining a running run)."""
        from palaestra.engines.weights.weight_transfer import DistributedWeightSender

        sync = self.sync
        if isinstance(sync.sender, DistributedWeightSender):
            await sync.sender.close()  # one weight-update group at a time (a fixed port)
        spec = sync.push_spec()
        if client is not None:
            spec = spec.only(client.url, client.tp_size)
        stats: TransferStats = await asyncio.to_thread(
            self.group.push_weights, spec, version, keep=client is None)
        clients = [client] if client is not None else sync.server_clients()
        await asyncio.gather(*(c.get_model_info() for c in clients))  # their weight_version
        return stats

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        if out and self._unflushed is not None:
            out["sync/unflushed_servers"] = float(self._unflushed)
        return out


class SenderPush(_Timed):
    """Buckets of the backend's weights through the sender of the path (NCCL/gloo broadcast,
    disk, CUDA IPC)."""

    def __init__(self, sync: EngineSync, backend: WeightSource) -> None:
        self.sync, self.backend = sync, backend

    async def push(self, version: int) -> TransferStats:
        s = self.sync
        assert s.sender is not None  # build_push checked it
        buckets = self.backend.iter_engine_weight_buckets(s.bucket_bytes, dtype=s.dtype,
                                                          device=s.device)
        self.last = await s.sender.push(buckets, version)
        return self.last

    def metrics(self) -> dict[str, float]:
        from palaestra.engines.weights.weight_transfer import (
            DistributedWeightSender,
            IpcWeightSender,
        )

        out = super().metrics()
        sender = self.sync.sender
        if out and isinstance(sender, (DistributedWeightSender, IpcWeightSender)):
            out["sync/unflushed_servers"] = float(sender.unflushed)  # kept their prefix cache
        return out


class WholeWeightsPush(_Timed):
    """The whole state dict through the engine's ``update_weights``: copied in process into the
    embedded engine, or base64 tensors over HTTP to servers (``tensor``)."""

    def __init__(self, sync: EngineSync, backend: WeightSource) -> None:
        self.sync, self.backend = sync, backend

    async def push(self, version: int) -> TransferStats:
        from palaestra.engines.weights.weight_transfer import TransferStats

        engine = self.sync.engine
        start = time.perf_counter()
        weights = self.backend.state_dict_for_engines(  # straight onto the engine's device
            dtype=self.sync.dtype, device=self.sync.engine_device)
        await engine.update_weights(weights, version=version)
        unique = {t.data_ptr(): t for t in weights.values()}.values()  # tied weights count once
        self.last = TransferStats(time.perf_counter() - start,
                                  sum(t.numel() * t.element_size() for t in unique),
                                  len(weights), 1)
        return self.last


class AdapterInProcessPush(_Timed):
    """A LoRA backend's adapter alone to an engine that applies adapters in process (the whole
    weights while the backend has no adapter yet)."""

    def __init__(self, sync: EngineSync, backend: WeightSource, engine: AdapterHost) -> None:
        self.sync, self.backend, self.engine = sync, backend, engine
        self.trainer = cast(AdapterTrainer, backend)  # build_push checked it
        self._whole = WholeWeightsPush(sync, backend)

    async def push(self, version: int) -> TransferStats:
        from palaestra.engines.weights.weight_transfer import TransferStats

        start = time.perf_counter()
        adapter = self.trainer.adapter_for_engines()
        if adapter is None:  # no adapter after all: the whole weights
            self.last = await self._whole.push(version)
            return self.last
        state, config = adapter
        dtype = self.sync.dtype or self.sync.engine_dtype  # what the engine computes in
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
        lora = cast(AdapterSettings, self.trainer.lora)  # set: build_push checked it
        await self.engine.update_adapter(state, config, name=lora.adapter_name,
                                         version=version)
        self.last = TransferStats(time.perf_counter() - start,
                                  sum(t.numel() * t.element_size() for t in state.values()),
                                  len(state), 1)
        return self.last


def build_push(sync: EngineSync, backend: WeightSource) -> SyncPush:
    """The one path the weights of ``backend`` take to ``sync.engine``, from their types: the
    backend's (`palaestra.contracts.AdapterTrainer` with ``lora`` set, a trainer group that
    `PushesOwnWeights`) and the engine's (`palaestra.engine.AdapterHost`, `AdapterServing`)."""
    from palaestra.trainers.group.push import REMOTE_METHODS, PushesOwnWeights

    adapter = trains_adapter(backend)
    engine = sync.engine
    if sync.lora_servers and adapter and not isinstance(engine, AdapterHost):
        if sync.adapter_dir is None or not isinstance(engine, AdapterServing):
            raise ConfigError("LoRA to servers needs an engine with /load_lora_adapter "
                              "(SGLangEngine) and a run directory (EngineSync.from_config)")
        return AdapterToServersPush(sync, backend, engine, sync.adapter_dir)
    if isinstance(backend, PushesOwnWeights) and sync.method in REMOTE_METHODS:
        return GroupPush(sync, backend)
    if sync.sender is not None:
        return SenderPush(sync, backend)
    if adapter and isinstance(engine, AdapterHost):
        return AdapterInProcessPush(sync, backend, engine)
    return WholeWeightsPush(sync, backend)


async def push_to_joining(push: SyncPush, client: SGLangClient, version: int
                          ) -> TransferStats:
    """The current weights to one more server only (an engine joining a running run), by the
    run's path: from a trainer group's rank 0, else through `EngineSync.push_to`."""
    if isinstance(push, GroupPush):
        return await push.push_to(version, client=client)
    return await push.sync.push_to(client, push.backend, version)


__all__ = [
    "AdapterInProcessPush",
    "AdapterToServersPush",
    "GroupPush",
    "SenderPush",
    "SyncPush",
    "WholeWeightsPush",
    "build_push",
    "push_to_joining",
]

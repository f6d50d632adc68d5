"""The push classes of the weight sync: one class per way the weights of a backend reach the
engines, picked once per backend by `choose_push` from typed capabilities (the backend's:
`palaestra.contracts.AdapterTrainer` with ``lora`` set, a trainer group that `PushesOwnWeights`;
the engine's: `palaestra.engine.AdapterHost`) instead of probing attributes at every push.

- `AdapterToServersPush`: a LoRA adapter to SGLang servers, as a peft folder they load by name;
- `GroupPush`: a trainer group's rank 0 sends the weights itself;
- `SenderPush`: buckets through the path's sender (NCCL/gloo broadcast, disk, CUDA IPC);
- `AdapterInProcessPush`: the adapter alone into the embedded engine;
- `WholeWeightsPush`: the whole state dict through ``update_weights`` (in process, or HTTP
  tensors to servers).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from palaestra.contracts import AdapterSettings, AdapterTrainer, WeightSource, trains_adapter
from palaestra.engine import AdapterHost

if TYPE_CHECKING:
    from palaestra.engines.weights.weight_transfer import TransferStats
    from palaestra.run.engine_sync import EngineSync


class SyncPush(Protocol):
    """One way the weights of a backend reach the engines (one class per path)."""

    async def push(self, backend: WeightSource, version: int) -> TransferStats: ...


@dataclass(frozen=True)
class AdapterToServersPush:
    """A LoRA backend's adapter to SGLang servers: a peft folder they load by name."""

    sync: EngineSync

    async def push(self, backend: WeightSource, version: int) -> TransferStats:
        assert isinstance(backend, AdapterTrainer)  # choose_push checked it
        return await self.sync.push_adapter_to_servers(backend, version)


@dataclass(frozen=True)
class GroupPush:
    """A trainer group's rank 0 sends the weights to the servers itself."""

    sync: EngineSync

    async def push(self, backend: WeightSource, version: int) -> TransferStats:
        from palaestra.trainers.group.push import PushesOwnWeights

        assert isinstance(backend, PushesOwnWeights)  # choose_push checked it
        return await self.sync.push_from_group(backend, version)


@dataclass(frozen=True)
class SenderPush:
    """Buckets of the backend's weights through the sender of the path (NCCL/gloo broadcast,
    disk, CUDA IPC)."""

    sync: EngineSync
    sender: Any

    async def push(self, backend: WeightSource, version: int) -> TransferStats:
        s = self.sync
        buckets = backend.iter_engine_weight_buckets(s.bucket_bytes, dtype=s.dtype,
                                                     device=s.device)
        return await self.sender.push(buckets, version)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class AdapterInProcessPush:
    """A LoRA backend's adapter alone to an engine that applies adapters in process."""

    sync: EngineSync
    engine: AdapterHost

    async def push(self, backend: WeightSource, version: int) -> TransferStats:
        from palaestra.engines.weights.weight_transfer import TransferStats

        assert isinstance(backend, AdapterTrainer)  # choose_push checked it
        start = time.perf_counter()
        adapter = backend.adapter_for_engines()
        if adapter is None:  # no adapter after all: the whole weights
            return await WholeWeightsPush(self.sync).push(backend, version)
        state, config = adapter
        dtype = self.sync.dtype or getattr(self.engine, "dtype", None)  # what it computes in
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
        lora = cast(AdapterSettings, backend.lora)  # set: choose_push checked trains_adapter
        await self.engine.update_adapter(state, config, name=lora.adapter_name,
                                         version=version)
        return TransferStats(time.perf_counter() - start,
                             sum(t.numel() * t.element_size() for t in state.values()),
                             len(state), 1)


@dataclass(frozen=True)
class WholeWeightsPush:
    """The whole state dict through the engine's ``update_weights``: copied in process into the
    embedded engine, or base64 tensors over HTTP to servers (``tensor``)."""

    sync: EngineSync

    async def push(self, backend: WeightSource, version: int) -> TransferStats:
        from palaestra.engines.weights.weight_transfer import TransferStats

        engine = self.sync.engine
        start = time.perf_counter()
        weights = backend.state_dict_for_engines(  # straight onto the engine's device
            dtype=self.sync.dtype, device=getattr(engine, "device", "cpu"))
        await engine.update_weights(weights, version=version)
        unique = {t.data_ptr(): t for t in weights.values()}.values()  # tied weights count once
        return TransferStats(time.perf_counter() - start,
                             sum(t.numel() * t.element_size() for t in unique),
                             len(weights), 1)


def choose_push(sync: EngineSync, backend: WeightSource) -> SyncPush:
    """The one path the weights of ``backend`` take to ``sync.engine``, from their types: the
    backend's (`palaestra.contracts.AdapterTrainer` with ``lora`` set, a trainer group that
    `PushesOwnWeights`) and the engine's (`palaestra.engine.AdapterHost`)."""
    from palaestra.trainers.group.push import REMOTE_METHODS, PushesOwnWeights

    adapter = trains_adapter(backend)
    engine = sync.engine
    if sync.lora_servers and adapter and not isinstance(engine, AdapterHost):
        return AdapterToServersPush(sync)
    if isinstance(backend, PushesOwnWeights) and sync.method in REMOTE_METHODS:
        return GroupPush(sync)
    if sync.sender is not None:
        return SenderPush(sync, sync.sender)
    if adapter and isinstance(engine, AdapterHost):
        return AdapterInProcessPush(sync, engine)
    return WholeWeightsPush(sync)


__all__ = [
    "AdapterInProcessPush",
    "AdapterToServersPush",
    "GroupPush",
    "SenderPush",
    "SyncPush",
    "WholeWeightsPush",
    "choose_push",
]

"""Weights from the training backend to the rollout engines after every step, by one path.

`EngineSync.from_config` picks the path of ``[engine]`` (``weight_sync``): the embedded engine's
tensors overwritten in process; SGLang servers through a weight-update group (NCCL or gloo
broadcast), through disk, or base64 tensors over HTTP. `EngineSync.push` is what the rollout
manager runs between pausing and resuming generation; `last` holds the timing of the newest push
(logged as ``sync/*``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from palaestra.errors import ConfigError

if TYPE_CHECKING:
    from palaestra.rollout.engines.weight_transfer import TransferStats
    from palaestra.trainers.config import TrainConfig


def resolve_method(cfg: TrainConfig) -> str:
    """The concrete path of ``engine.weight_sync`` (``auto`` decided by engine kind and CUDA)."""
    method = cfg.engine.weight_sync
    if method != "auto":
        return method
    if cfg.engine.kind == "local":
        return "in_process"
    import torch

    return "distributed" if torch.cuda.is_available() else "disk"


class EngineSync:
    """One sync path, its sender (for SGLang servers) and the timing of the last push."""

    def __init__(self, method: str, engine: Any, *, sender: Any = None, bucket_bytes: int,
                 dtype: Any = None, device: str = "cpu") -> None:
        self.method = method
        self.engine = engine
        self.sender = sender
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self.device = device
        self.last: TransferStats | None = None

    @classmethod
    def from_config(cls, cfg: TrainConfig, engine: Any, policy_path: Path) -> EngineSync:
        import torch

        from palaestra.rollout.engines.weight_transfer import (
            DiskWeightSender,
            DistributedWeightSender,
        )

        e = cfg.engine
        method = resolve_method(cfg)
        dtype = getattr(torch, e.sync_dtype) if e.sync_dtype else None
        sender: Any = None
        device = "cpu"
        if method == "distributed":
            if e.sync_backend == "nccl" and not torch.cuda.is_available():
                raise ConfigError("engine.sync_backend = 'nccl' needs CUDA here; use 'gloo' "
                                  "or engine.weight_sync = 'disk'")
            sender = DistributedWeightSender(
                engine.clients, backend=e.sync_backend, master_address=e.sync_master_address,
                master_port=e.sync_master_port, timeout_s=e.sync_timeout_s)
            if e.sync_backend == "nccl":  # a CUDA snapshot of the weights: no host round trip
                device = "cuda"
        elif method == "disk":
            sender = DiskWeightSender(engine.clients, e.sync_dir.replace("{out}", cfg.out),
                                      model_dir=policy_path, keep_last=2)
        return cls(method, engine, sender=sender, bucket_bytes=e.sync_bucket_mb << 20,
                   dtype=dtype, device=device)

    def push(self, backend: Any, version: int) -> Callable[[Any], Awaitable[None]]:
        """The transfer of ``backend``'s weights as ``version``, for `RolloutManager.update_weights`."""
        async def run(_control: Any) -> None:
            await self.push_now(backend, version)

        return run

    async def push_now(self, backend: Any, version: int) -> TransferStats:
        """Move the weights now (generation should be paused) and time it."""
        from palaestra.rollout.engines.weight_transfer import TransferStats

        if self.sender is not None:
            buckets = backend.iter_engine_weight_buckets(
                self.bucket_bytes, dtype=self.dtype, device=self.device)
            self.last = await self.sender.push(buckets, version)
            return self.last
        start = time.perf_counter()
        weights = backend.state_dict_for_engines(  # straight onto the engine's device
            dtype=self.dtype, device=getattr(self.engine, "device", "cpu"))
        await self.engine.update_weights(weights, version=version)
        unique = {t.data_ptr(): t for t in weights.values()}.values()  # tied weights count once
        self.last = TransferStats(time.perf_counter() - start,
                                  sum(t.numel() * t.element_size() for t in unique),
                                  len(weights), 1)
        return self.last

    async def push_checkpoint(self, path: Path, version: int) -> None:
        """Load a Hugging Face checkpoint folder into the engines (e.g. the warm-started policy):
        by path for the embedded engine, through the sender for servers, which may not see
        this machine's disk."""
        from palaestra.rollout.engines.model import iter_safetensors, safetensors_files
        from palaestra.rollout.engines.weight_transfer import bucketize

        if self.sender is None:
            await self.engine.update_weights(path=str(path), version=version)
            return
        named = iter_safetensors(safetensors_files(path))
        if self.dtype is not None:
            named = ((n, t.to(self.dtype) if t.is_floating_point() else t) for n, t in named)
        self.last = await self.sender.push(bucketize(named, self.bucket_bytes), version)

    def metrics(self) -> dict[str, float]:
        """``sync/*`` of the last push (empty before the first), with the servers that declined
        to flush their prefix cache afterwards (their cached prefixes predate the weights)."""
        if self.last is None:
            return {}
        out = self.last.as_metrics()
        if self.sender is not None and hasattr(self.sender, "unflushed"):
            out["sync/unflushed_servers"] = float(self.sender.unflushed)
        return out

    async def close(self) -> None:
        """Tear down the sender's weight-update group (nothing for the other paths)."""
        if self.sender is not None:
            await self.sender.close()


__all__ = ["EngineSync", "resolve_method"]

"""Process-group helpers and FSDP2 sharding for the torch backend.

Single process (world size 1) is the default and never touches ``torch.distributed``. Under
``torchrun`` (or Ray workers that set ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``)
the group is initialised here (NCCL on CUDA, gloo on CPU) and the model is sharded with FSDP2:
``fully_shard`` on every decoder layer (the classes in the model's ``_no_split_modules``) and
then on the root, with bf16 parameters and fp32 gradient reduction when training in bf16.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from palaestra.errors import ConfigError


@dataclass(frozen=True)
class DistInfo:
    """Rank, world size and the device of this process."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(device_spec: str) -> DistInfo:
    """Join the process group when ``WORLD_SIZE`` > 1 and pick this rank's device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1 and not (
        torch.distributed.is_available() and torch.distributed.is_initialized()
    ):
        return DistInfo(0, 1, 0, resolve_device(device_spec))
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and device_spec != "cpu"
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def resolve_device(spec: str) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; anything else as given."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={spec!r} but CUDA is not available; use device='cpu'")
    return device


def apply_fsdp2(
    model: torch.nn.Module,
    info: DistInfo,
    *,
    param_dtype: torch.dtype | None,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """Shard ``model`` in place with FSDP2 (decoder layers first, then the root)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # an explicit mesh: FSDP's default one lives on CUDA whenever CUDA exists, even for gloo
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
        "reshard_after_forward": reshard_after_forward,
    }
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def all_reduce_sum(values: dict[str, float], info: DistInfo) -> dict[str, float]:
    """Sum a dict of floats over ranks (same keys on every rank, in the same order)."""
    if not info.is_distributed or not values:
        return values
    import torch.distributed as dist

    keys = sorted(values)
    buf = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=info.device)
    dist.all_reduce(buf)
    return dict(zip(keys, buf.tolist()))


def all_reduce_max(values: dict[str, float], info: DistInfo) -> dict[str, float]:
    """Maximum of a dict of floats over ranks (same keys on every rank)."""
    if not info.is_distributed or not values:
        return values
    import torch.distributed as dist

    keys = sorted(values)
    buf = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=info.device)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return dict(zip(keys, buf.tolist()))


def all_reduce_max_int(value: int, info: DistInfo) -> int:
    """Maximum of an int over ranks."""
    if not info.is_distributed:
        return value
    import torch.distributed as dist

    buf = torch.tensor([value], dtype=torch.long, device=info.device)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return int(buf.item())


def all_gather_objects(obj: object, info: DistInfo) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order."""
    if not info.is_distributed:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(info: DistInfo) -> None:
    if info.is_distributed:
        import torch.distributed as dist

        dist.barrier()


__all__ = [
    "DistInfo",
    "all_gather_objects",
    "all_reduce_max_int",
    "all_reduce_sum",
    "apply_fsdp2",
    "barrier",
    "resolve_device",
    "setup_distributed",
]

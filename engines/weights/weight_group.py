"""A weight-update process group beside torch's default one, made the way SGLang makes it.

SGLang's ``/init_weights_update_group`` joins the trainer in a torch.distributed group of its
own: a TCP rendezvous at ``master_address:master_port`` (served by rank 0, the trainer), a
``PrefixStore`` named after the group, then ``_new_process_group_helper``; ranks map to
themselves so ``broadcast(src=0)`` means the trainer. `init_weight_group` builds exactly that
group on either side (the trainer here, `palaestra serve` there), so a palaestra trainer can
feed a real SGLang server and an SGLang-style trainer can feed `palaestra serve`.
``/update_weights_from_distributed`` then broadcasts tensor by tensor, in the order of the
request's ``names``, with dtype names as ``str(dtype)`` without ``torch.`` ("bfloat16").

The helper is private torch API (every RL framework that talks to SGLang uses it); its keyword
for backend options changed name in torch 2.6, which `init_weight_group` looks up.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from palaestra.errors import ConfigError, EngineError

if TYPE_CHECKING:
    import torch

DEFAULT_GROUP_NAME = "palaestra_weight_sync"


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's wire name of a dtype: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` ("bfloat16" or "torch.bfloat16"); ConfigError if unknown."""
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"unknown dtype {name!r}; send torch dtype names such as 'bfloat16'")
    return dtype


def wait_for_listener(host: str, port: int, timeout_s: float) -> None:
    """Return once ``host:port`` accepts a TCP connection; `EngineError` after ``timeout_s``.

    A joining rank probes the trainer's store first: torch's own client would retry a closed
    port silently for the whole group timeout (minutes), this says within seconds what is wrong.
    """
    import socket
    import time

    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(min(left, 2.0), 0.05)):
                return
        except OSError as exc:
            last = exc
        if time.monotonic() + 0.1 >= deadline:
            raise EngineError(
                f"nothing accepts connections at {host}:{port} (the weight-update group's "
                f"rendezvous, served by the trainer, rank 0) after {timeout_s:g} s: {last}; "
                "start the trainer's group first or fix master_address/master_port")
        time.sleep(0.1)


def init_weight_group(
    *, backend: str, master_address: str, master_port: int, world_size: int, rank: int,
    group_name: str = DEFAULT_GROUP_NAME, timeout_s: float = 600.0,
    device: torch.device | None = None, connect_timeout_s: float | None = None,
) -> Any:
    """Join (rank 0: host) the weight-update group; blocks until all ``world_size`` ranks joined.

    ``backend`` is "nccl" (CUDA tensors) or "gloo" (CPU tensors). The NCCL communicator is
    created lazily, at the first broadcast, as upstream SGLang does: an eager side (``device``
    given) waits in here for peers that only connect at that broadcast, so pass ``device`` only
    when every member is eager too. ``timeout_s`` bounds the rendezvous and every later
    collective; a joining rank (``rank > 0``) with ``connect_timeout_s`` first waits at most that
    long for the trainer's store to listen (`wait_for_listener`).
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    if backend not in ("nccl", "gloo"):
        raise ConfigError(f"weight-update backend {backend!r} is not supported; use nccl or gloo")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside the group of {world_size}")
    if not dist.is_available():
        raise EngineError("this torch build has no torch.distributed")
    if rank > 0 and connect_timeout_s is not None:
        wait_for_listener(master_address, master_port, min(connect_timeout_s, timeout_s))
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(
        f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)  # SGLang's prefix: one store may host several groups
    kwargs: dict[str, Any] = {"group_name": group_name, "timeout": timeout}
    params = inspect.signature(_new_process_group_helper).parameters
    kwargs["backend_options" if "backend_options" in params else "pg_options"] = None
    if device is not None and "device_id" in params:
        kwargs["device_id"] = device
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, **kwargs)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_weight_group(group: Any) -> None:
    """Tear the group down (both sides should; a dead peer is not an error here)."""
    import torch.distributed as dist

    try:
        dist.destroy_process_group(group)
    except (RuntimeError, ValueError, KeyError):
        pass


def broadcast_tensors(group: Any, tensors: Sequence[torch.Tensor]) -> None:
    """Rank 0's side of one ``/update_weights_from_distributed``: broadcast each tensor in order."""
    import torch.distributed as dist

    sent = [t.contiguous() for t in tensors]  # held until every broadcast finished
    works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in sent]
    for work in works:
        work.wait()


def receive_tensors(
    group: Any, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
    device: Any,
) -> list[tuple[str, torch.Tensor]]:
    """A receiver's side: empty tensors of the announced dtypes/shapes, filled by broadcasts."""
    import torch
    import torch.distributed as dist

    if not len(names) == len(dtypes) == len(shapes):
        raise ConfigError("names, dtypes and shapes must have the same length")
    out = [(n, torch.empty([int(s) for s in shape], dtype=parse_dtype(d), device=device))
           for n, d, shape in zip(names, dtypes, shapes, strict=True)]
    works = [dist.broadcast(t, src=0, group=group, async_op=True) for _, t in out]
    for work in works:
        work.wait()
    return out


__all__ = [
    "DEFAULT_GROUP_NAME",
    "broadcast_tensors",
    "destroy_weight_group",
    "dtype_name",
    "init_weight_group",
    "parse_dtype",
    "receive_tensors",
    "wait_for_listener",
]

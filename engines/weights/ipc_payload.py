"""Same-host tensor handles in ``/update_weights_from_tensor``: SGLang's wire format, both ways.

SGLang's ``serialized_named_tensors`` entry (one per TP rank) is base64 of a
``ForkingPickler`` pickle of a list of ``(name, tensor)`` pairs (``MultiprocessingSerializer``):
torch's multiprocessing reductions put a **CUDA IPC handle** in the pickle for a CUDA tensor (the
receiver maps the sender's memory: no copy through the host, no bytes over HTTP) and a
shared-memory handle for a CPU tensor. Two details make it work between two unrelated processes:

* CUDA: the device is named by its **UUID**, not its index (SGLang's ``patch_torch`` does the
  same; the two processes may see the GPU under different indices, e.g. different
  ``CUDA_VISIBLE_DEVICES``); the receiver maps the UUID back to its own index.
* CPU: the storage is shared through a file name under torch's shm manager (torch's
  ``file_system`` strategy), chosen for these tensors only; the default ``file_descriptor``
  strategy passes descriptors through a socket that only the sender's multiprocessing children
  may open (it authenticates with their shared authkey).

`encode_ipc_named_tensors` returns the payload and the tensors the receiver will map: the caller
keeps them alive until the server answered. `decode_ipc_named_tensors` unpickles with an
allowlist (torch's rebuild functions, storages and dtypes; SGLang's patched CUDA rebuild name
resolves to ours), so a payload cannot run arbitrary code; the tensors it returns alias the
sender's memory and must be copied before the answer goes out.
"""

from __future__ import annotations

import base64
import io
import pickle
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from palaestra.errors import ConfigError

if TYPE_CHECKING:
    import torch

_DEVICE_ARG = 6  # the device in torch's rebuild_cuda_tensor arguments (stable since torch 1.x)
_REDUCTIONS = "torch.multiprocessing.reductions"
_CUDA_REBUILD_NAMES = frozenset({"rebuild_cuda_tensor", "_rebuild_cuda_tensor_modified"})


def is_pickle(raw: bytes) -> bool:
    """Whether ``raw`` starts like a pickle of protocol 2 or later (SGLang's payloads)."""
    return len(raw) > 2 and raw[0] == 0x80 and 2 <= raw[1] <= 5


def device_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` as SGLang names devices in its payloads."""
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def _device_index(device: int | str) -> int:
    """This process's index of a device named by index or UUID."""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("this /update_weights_from_tensor payload carries CUDA IPC handles and "
                          "this server has no CUDA device; send CPU tensors (shared memory) to "
                          "a CPU server, or use engine.weight_sync.kind = 'tensor'")
    if isinstance(device, int):
        return device
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == device:
            return index
    raise ConfigError(f"the weights live on GPU {device}, which this server does not see: CUDA "
                      "IPC needs trainer and server on the same host with that GPU visible to "
                      "both; use engine.weight_sync.kind = 'distributed' across GPUs or hosts")


def rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    """torch's CUDA rebuild with the device given by UUID or index (SGLang's convention)."""
    from torch.multiprocessing import reductions

    fixed = list(args)
    fixed[_DEVICE_ARG] = _device_index(fixed[_DEVICE_ARG])
    original = getattr(reductions, "_rebuild_cuda_tensor_original", reductions.rebuild_cuda_tensor)
    return original(*fixed)  # type: ignore[no-any-return]


def _reduce_tensor(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda and isinstance(args[_DEVICE_ARG], int):  # SGLang's patch names UUIDs
        args = (*args[:_DEVICE_ARG], device_uuid(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1:])
    return rebuild, args


def _reduce_storage(storage: torch.UntypedStorage) -> tuple[Any, tuple[Any, ...]]:
    """A CPU storage by shm file name (torch's file_system strategy, for this pickle only)."""
    from torch.multiprocessing import reductions

    if storage.device.type != "cpu":
        raise ConfigError(f"cannot share a {storage.device} storage by handle; pickle its tensor")
    if storage.nbytes() == 0:
        return reductions.rebuild_storage_empty, (type(storage),)
    manager, handle, size = storage._share_filename_cpu_()  # type: ignore[attr-defined]
    storage._shared_incref()  # type: ignore[attr-defined]  # torch's reduce_storage does it too
    reductions.shared_cache[handle] = reductions.StorageWeakRef(storage)
    return reductions.rebuild_storage_filename, (type(storage), manager, handle, size)


_ALIGN = 256  # bytes: every packed tensor starts aligned for any dtype and vector loads


def _pack(pairs: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, torch.Tensor]],
                                                           list[torch.Tensor]]:
    """The tensors copied into one flat buffer per device, as views of it, and the buffers.

    One buffer means one handle for the receiver to open (opening CUDA IPC handles, or shm
    files, one per tensor costs more than one device copy of the bucket), and the caller's own
    tensors are never shared (sharing a CPU tensor moves its storage into shm in place)."""
    import torch

    out = list(pairs)
    buffers: list[torch.Tensor] = []
    for device in dict.fromkeys(t.device for _, t in pairs):
        index = [i for i, (_, t) in enumerate(pairs) if t.device == device]
        sizes = [pairs[i][1].numel() * pairs[i][1].element_size() for i in index]
        flat = torch.empty(sum(-(-n // _ALIGN) * _ALIGN for n in sizes), dtype=torch.uint8,
                           device=device)
        offset = 0
        for i, n in zip(index, sizes, strict=True):
            name, t = pairs[i]
            view = flat[offset:offset + n].view(t.dtype).view(t.shape)
            view.copy_(t)
            out[i] = (name, view)
            offset += -(-n // _ALIGN) * _ALIGN
        buffers.append(flat)
    return out, buffers


def encode_ipc_named_tensors(named: Iterable[tuple[str, torch.Tensor]], *, pack: bool = True
                             ) -> tuple[str, list[torch.Tensor]]:
    """base64 of the ``(name, tensor)`` list as SGLang's ``MultiprocessingSerializer`` writes it,
    and the tensors the handles point at (keep them alive until the server answered).

    ``pack`` (default): the tensors are copied into one buffer per device first and travel as
    views of it (one handle per bucket, see `_pack`); else CUDA tensors travel as they are (the
    server maps the caller's own memory) and CPU tensors as shared copies."""
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing  # registers torch's reductions with ForkingPickler

    pairs: list[tuple[str, torch.Tensor]] = []
    for name, tensor in named:
        t = tensor.detach()
        if t.device.type not in ("cpu", "cuda"):
            raise ConfigError(f"{name}: tensors on {t.device} cannot travel by handle")
        if t.device.type == "cpu" and not pack:
            t = t.clone(memory_format=torch.contiguous_format)
        pairs.append((name, t))
    alive: list[torch.Tensor] = []
    if pack and pairs:
        pairs, alive = _pack(pairs)
    buf = io.BytesIO()
    pickler = ForkingPickler(buf, pickle.HIGHEST_PROTOCOL)
    table = pickler.dispatch_table  # this pickler's own copy
    table[torch.UntypedStorage] = _reduce_storage
    for cls in (torch.Tensor, torch.nn.Parameter):
        table[cls] = _reduce_tensor
    pickler.dump(pairs)
    return base64.b64encode(buf.getvalue()).decode("ascii"), alive + [t for _, t in pairs]


class _WeightUnpickler(pickle.Unpickler):
    """Only what a list of shared tensors needs: torch's rebuild functions, storages, dtypes."""

    _REBUILDS = frozenset({"rebuild_tensor", "rebuild_typed_storage", "rebuild_typed_storage_child",
                           "rebuild_storage_filename", "rebuild_storage_empty"})

    def find_class(self, module: str, name: str) -> Any:
        import torch
        from torch.multiprocessing import reductions

        if name in _CUDA_REBUILD_NAMES and (module == _REDUCTIONS or module.startswith("sglang.")):
            return rebuild_cuda_tensor
        if module == _REDUCTIONS and name in self._REBUILDS:
            return getattr(reductions, name)
        if module == _REDUCTIONS and name == "rebuild_storage_fd":
            raise ConfigError(
                "this payload shares CPU tensors by file descriptor (torch's default "
                "file_descriptor strategy), which only the sender's own multiprocessing "
                "children can open; encode with palaestra.engines.weights.ipc_payload."
                "encode_ipc_named_tensors (file names under torch's shm manager)")
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype) or name in ("Size", "Tensor"):
                return value
        if (module, name) in (("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
                              ("torch", "UntypedStorage"), ("torch.nn.parameter", "Parameter")):
            return getattr(torch.nn.parameter if module.endswith("parameter") else torch, name)
        raise ConfigError(f"/update_weights_from_tensor payload names {module}.{name}, which a "
                          "list of (name, tensor) pairs does not need; refused")


def decode_ipc_named_tensors(raw: bytes) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of one decoded payload entry (tensors alias the sender's
    memory: copy them, then drop them)."""
    import torch

    try:
        obj = _WeightUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as exc:
        raise ConfigError(f"serialized_named_tensors: not a tensor pickle ({exc})") from exc
    except RuntimeError as exc:  # torch could not map the handle (freed, other host, no shm)
        raise ConfigError(f"serialized_named_tensors: a tensor handle could not be opened here "
                          f"({exc}); sender and server must share the host (and the GPU), and "
                          "the sender must keep the tensors alive until the answer") from exc
    if isinstance(obj, dict):
        raise ConfigError("serialized_named_tensors holds a flattened bucket (load_format "
                          "'flattened_bucket'), which palaestra serve does not take; send a "
                          "list of (name, tensor) pairs with load_format null")
    pairs = list(obj) if isinstance(obj, list | tuple) else None
    if pairs is None or not all(isinstance(p, tuple | list) and len(p) == 2 and isinstance(p[0], str)
                                and isinstance(p[1], torch.Tensor) for p in pairs):
        raise ConfigError("serialized_named_tensors entries must each hold a list of "
                          "(name, tensor) pairs (SGLang's IPC pickle) or base64 safetensors bytes")
    return [(str(n), t) for n, t in pairs]


__all__ = ["decode_ipc_named_tensors", "device_uuid", "encode_ipc_named_tensors", "is_pickle",
           "rebuild_cuda_tensor"]

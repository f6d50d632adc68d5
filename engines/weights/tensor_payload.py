"""Named tensors in ``/update_weights_from_tensor``'s ``serialized_named_tensors`` (one per TP rank).

SGLang fills each entry with ``MultiprocessingSerializer.serialize(named_tensors)`` (a pickle
that carries CUDA IPC handles or shared-memory file descriptors, so the tensors never travel
over HTTP: the trainer and the server share a host), base64-encoded for JSON. Those handles only
mean something to torch's multiprocessing reductions on the same host and device.

`palaestra serve` accepts both forms, told apart by their first bytes (`decode_payload`): SGLang's
pickle of handles (same host; `ipc_payload` unpickles it with an allowlist, so it cannot run
arbitrary code) and a self-contained, same-host-or-not form: base64 of the **safetensors**
serialisation of the named tensors (``safetensors.torch.save``), detected by its header (8-byte
little-endian length followed by a JSON object).
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from palaestra.errors import ConfigError

if TYPE_CHECKING:
    import torch

SAFETENSORS_FORMAT = "safetensors"


def encode_named_tensors(named: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> str:
    """base64(safetensors bytes) of (name, tensor) pairs (tensors are made contiguous, on CPU)."""
    from safetensors.torch import save

    pairs = named.items() if isinstance(named, Mapping) else named
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in pairs}
    return base64.b64encode(save(tensors)).decode("ascii")


def is_safetensors(raw: bytes) -> bool:
    if len(raw) < 10:
        return False
    (n,) = struct.unpack("<Q", raw[:8])
    if n <= 0 or 8 + n > len(raw):
        return False
    try:
        header = json.loads(raw[8 : 8 + n])
    except ValueError:
        return False
    return isinstance(header, dict)


def decode_named_tensors(payload: str) -> dict[str, torch.Tensor]:
    """Inverse of `encode_named_tensors`; a non-safetensors payload raises `ConfigError`."""
    from safetensors.torch import load

    try:
        raw = base64.b64decode(payload, validate=True)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"serialized_named_tensors entries must be base64 strings: {exc}") from exc
    if not is_safetensors(raw):
        raise ConfigError(
            "serialized_named_tensors must hold base64 safetensors bytes for palaestra serve "
            "(see palaestra.engines.weights.tensor_payload.encode_named_tensors); SGLang's "
            "MultiprocessingSerializer payloads carry process-local handles and are not accepted"
        )
    return load(raw)


def decode_payload(payload: str) -> tuple[list[tuple[str, torch.Tensor]], bool]:
    """The ``(name, tensor)`` pairs of one entry, either form; the flag says whether they are
    handles into the sender's memory (an IPC pickle: copy them before answering)."""
    from palaestra.engines.weights.ipc_payload import decode_ipc_named_tensors, is_pickle

    try:
        raw = base64.b64decode(payload, validate=True)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"serialized_named_tensors entries must be base64 strings: {exc}") from exc
    if is_safetensors(raw):
        from safetensors.torch import load

        return list(load(raw).items()), False
    if is_pickle(raw):
        return decode_ipc_named_tensors(raw), True
    raise ConfigError(
        "serialized_named_tensors entries must hold base64 safetensors bytes or SGLang's "
        "MultiprocessingSerializer pickle of (name, tensor) pairs (see "
        "palaestra.engines.weights.tensor_payload and ipc_payload)")


__all__ = ["SAFETENSORS_FORMAT", "decode_named_tensors", "decode_payload", "encode_named_tensors",
           "is_safetensors"]

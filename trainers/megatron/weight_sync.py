"""Weight sync from a Megatron model to inference engines: HF-named buckets, timed.

`iter_hf_buckets` groups the gathered HF tensors into buckets of about ``bucket_bytes`` so a
consumer (an in-process engine, an NCCL broadcast, a disk writer) handles a bounded amount of
memory at a time. `sync_weights` drives one sync and times it. `module_copier` is the colocated
in-process consumer: it copies each tensor into the matching parameter of an HF module (also
into transformers-5's fused expert tensors), with no allocation on the receiving side.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from palaestra.engines.weights.weight_transfer import TransferStats, bucketize
from palaestra.errors import EngineError
from palaestra.trainers.megatron.arch import ModelArch
from palaestra.trainers.megatron.weights import iter_hf_weights

if TYPE_CHECKING:
    import torch

Bucket = list[tuple[str, "torch.Tensor"]]
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


SyncStats = TransferStats  # one timing record for every sync path


def iter_hf_buckets(
    model: torch.nn.Module, arch: ModelArch, *, bucket_bytes: int = 1 << 30, dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> Iterator[Bucket]:
    """HF-named full tensors of this pipeline stage, in buckets (collective over TP/EP).

    ``dtype`` casts, ``device`` moves (None: where the model lives).
    """
    named = iter_hf_weights(model, arch)
    if dtype is not None or device is not None:
        named = ((n, t.to(device=device, dtype=dtype)) for n, t in named)
    return bucketize(named, bucket_bytes)


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def sync_weights(
    model: torch.nn.Module,
    arch: ModelArch,
    consumer: Callable[[Bucket], None],
    *,
    bucket_bytes: int = 1 << 30,
    dtype: torch.dtype | None = None,
) -> SyncStats:
    """Feed every HF-named bucket to ``consumer`` and time the whole sync."""
    _synchronize()
    start = time.perf_counter()
    nbytes = tensors = buckets = 0
    for bucket in iter_hf_buckets(model, arch, bucket_bytes=bucket_bytes, dtype=dtype):
        consumer(bucket)
        buckets += 1
        tensors += len(bucket)
        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
    _synchronize()
    return SyncStats(time.perf_counter() - start, nbytes, tensors, buckets)


def module_copier(module: torch.nn.Module) -> Callable[[Bucket], None]:
    """Consumer that copies HF-named tensors in place into ``module``'s parameters (and buffers).

    Understands transformers-5 fused experts (``experts.gate_up_proj[j]`` / ``down_proj[j]``).
    Raises EngineError for a name the module does not have.
    """
    import torch

    # tied aliases included; buffers too (a MoE router's expert bias is one)
    params = {**dict(module.named_buffers()), **dict(module.named_parameters(remove_duplicate=False))}

    def target(name: str) -> torch.Tensor:
        if name in params:
            return params[name]
        m = _EXPERT.match(name)
        if m is not None:
            base, j, kind = m.group(1), int(m.group(2)), m.group(3)
            if kind == "down_proj" and f"{base}.down_proj" in params:
                return params[f"{base}.down_proj"][j]
            fused = params.get(f"{base}.gate_up_proj")
            if fused is not None:
                half = fused.shape[1] // 2
                return fused[j, :half] if kind == "gate_proj" else fused[j, half:]
        raise EngineError(f"the receiving module has no parameter for {name!r}")

    def consume(bucket: Bucket) -> None:
        with torch.no_grad():
            for name, tensor in bucket:
                dst = target(name)
                if dst.shape != tensor.shape:
                    raise EngineError(
                        f"{name}: shape {tuple(tensor.shape)} != receiver {tuple(dst.shape)}"
                    )
                dst.copy_(tensor, non_blocking=True)

    return consume

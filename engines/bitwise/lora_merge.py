"""A LoRA adapter merged into its base weight, the same bits on both sides of bitwise on-policy
mode: the engine merging a pushed adapter and the torch trainer building its fused weights call
this one function."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def merged_weight(base: torch.Tensor, a: torch.Tensor, b_scaled: torch.Tensor, *,
                  invariant: bool, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``W_base + B A`` in ``dtype`` (default: the base's), summed in float32: ``a [r, in]``,
    ``b_scaled [out, r]`` (the scale folded in). ``invariant``: ``B A`` by the batch-invariant
    GEMM (`palaestra.engines.bitwise.invariant.linear`), as bitwise on-policy mode needs: the
    engine merging an adapter and the torch trainer building its fused weights
    (`palaestra.trainers.torch_backend.bitwise`) call this one function on the same float32
    matrices, so the merged weights have the same bits on both sides (and autograd runs
    through it on the trainer's)."""
    if invariant:
        from palaestra.engines.bitwise.invariant import linear

        delta = linear(b_scaled, a.t())
    else:
        delta = b_scaled @ a
    return (base.float() + delta).to(dtype or base.dtype)


__all__ = ["merged_weight"]

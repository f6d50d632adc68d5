"""Decode attention over the slot KV cache, each row to its own length (split-KV, Triton).

A decode step of the embedded engine attends one query per row to that row's keys in its cache
slot. The dense path (`Decoder.decode`'s batched GEMMs) reads every row's keys up to the padded
key length of the longest row and masks the rest; at the batch sizes of RL rollouts the key/value
reads are most of a decode step's memory traffic (Qwen3-0.6B, 256 rows of ~450 positions: ~13 GB
of KV per step against 1.2 GB of weights), and rows of an RL batch differ widely in length. This
kernel reads only ``lengths[b]`` positions of row ``b``:

- ``grid = (rows, query heads, splits)``: each program takes one query head of one row over one
  chunk of that row's positions (the chunks of positions past the row's length do nothing), with
  an online softmax in float32; a query head reads the keys of its key/value head (grouped-query
  attention: ``kv_head = head // (heads / kv_heads)``, as Hugging Face's ``repeat_kv`` groups);
- the chunks are merged by their log-sum-exp in a few torch ops.

Splits keep the GPU busy when rows are few (the tail of a rollout): their number depends only on
the batch and the key-length bucket, so a captured CUDA graph replays it with any lengths.
Triton is optional: `available` says whether this path can run (CUDA and an importable Triton);
``decode_attention = "auto"`` falls back to the dense path otherwise, and after a self-check
that compares the two on a small case (`self_check`). Measured on an H200 (docs/results.md,
2026-12-02 second session) it matches the dense path (greedy tokens equal, logprobs within
1e-4 in fp32) but did not make the issue-22 loop faster: one program per query head reads its
grouped key/value head once per query head (twice for Qwen3's 16/8 heads), which gives back
what the per-row lengths save; one program per key/value head serving its query heads is the
next step. So the engine's default stays dense.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

BLOCK_N = 64  # positions per inner iteration
TARGET_PROGRAMS = 2048  # enough programs to fill an H200's SMs several times over


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(q_ptr, k_ptr, v_ptr, len_ptr, acc_ptr, max_ptr, sum_ptr, scale,
                     stride_qb, stride_qh, stride_ks, stride_kh, stride_kn,
                     stride_vs, stride_vh, stride_vn, stride_ab, stride_ah, stride_as,
                     stride_mb, stride_mh,
                     REP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                     CHUNK: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        split = tl.program_id(2)
        kv_head = head // REP
        length = tl.load(len_ptr + row)
        start = split * CHUNK
        end = tl.minimum(start + CHUNK, length)
        dims = tl.arange(0, D)
        q = tl.load(q_ptr + row * stride_qb + head * stride_qh + dims).to(tl.float32) * scale
        k_base = k_ptr + row * stride_ks + kv_head * stride_kh
        v_base = v_ptr + row * stride_vs + kv_head * stride_vh
        running_max = -float("inf")
        running_sum = 0.0
        acc = tl.zeros([D], dtype=tl.float32)
        for first in range(start, end, BLOCK):
            pos = first + tl.arange(0, BLOCK)
            live = pos < end
            keys = tl.load(k_base + pos[:, None] * stride_kn + dims[None, :],
                           mask=live[:, None], other=0.0).to(tl.float32)
            scores = tl.sum(keys * q[None, :], axis=1)
            scores = tl.where(live, scores, -float("inf"))
            new_max = tl.maximum(tl.max(scores, axis=0), running_max)
            rescale = tl.exp(running_max - new_max)
            probs = tl.exp(scores - new_max)
            values = tl.load(v_base + pos[:, None] * stride_vn + dims[None, :],
                             mask=live[:, None], other=0.0).to(tl.float32)
            acc = acc * rescale + tl.sum(probs[:, None] * values, axis=0)
            running_sum = running_sum * rescale + tl.sum(probs, axis=0)
            running_max = new_max
        tl.store(acc_ptr + row * stride_ab + head * stride_ah + split * stride_as + dims, acc)
        tl.store(max_ptr + row * stride_mb + head * stride_mh + split, running_max)
        tl.store(sum_ptr + row * stride_mb + head * stride_mh + split, running_sum)

    return split_kernel


@functools.cache
def available(device_type: str) -> bool:
    """Whether the Triton path can run on this device type (CUDA with Triton importable)."""
    if device_type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def num_splits(rows: int, heads: int, key_len: int) -> int:
    """Chunks per row: enough programs for the GPU, never chunks shorter than a block."""
    blocks = max(1, math.ceil(key_len / BLOCK_N))
    return max(1, min(blocks, math.ceil(TARGET_PROGRAMS / max(1, rows * heads))))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     lengths: torch.Tensor, scale: float, key_len: int) -> torch.Tensor:
    """Attention of one query per row to the first ``lengths[b]`` keys of slot ``b``.

    ``q`` ``[B, H, D]`` (any strides with a unit last one), ``k_cache``/``v_cache`` one layer of
    the slot cache ``[slots, kv_heads, capacity, D]`` (rows ``0..B-1`` read), ``lengths`` ``[B]``
    integers in ``[1, key_len]``; ``key_len`` (the bucket, fixed for a captured graph) sets the
    chunking only. Returns ``[B, H, D]`` in ``q``'s dtype.
    """
    import torch

    b, heads, d = q.shape
    kv_heads = k_cache.shape[1]
    splits = num_splits(b, heads, key_len)
    chunk = math.ceil(math.ceil(key_len / splits) / BLOCK_N) * BLOCK_N
    acc = torch.empty(b, heads, splits, d, device=q.device, dtype=torch.float32)
    maxes = torch.empty(b, heads, splits, device=q.device, dtype=torch.float32)
    sums = torch.empty_like(maxes)
    _kernel()[(b, heads, splits)](
        q, k_cache, v_cache, lengths, acc, maxes, sums, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        acc.stride(0), acc.stride(1), acc.stride(2), maxes.stride(0), maxes.stride(1),
        REP=heads // kv_heads, D=d, BLOCK=BLOCK_N, CHUNK=chunk,
    )
    # merge the chunks by their log-sum-exp (empty chunks: max -inf, weight 0)
    top = maxes.amax(dim=-1, keepdim=True)
    weights = torch.exp(maxes - top)
    total = (sums * weights).sum(dim=-1, keepdim=True)
    out = (acc * weights.unsqueeze(-1)).sum(dim=2) / total
    return out.to(q.dtype)


def dense_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """The same attention in plain torch, float32 (tests and the self-check)."""
    import torch

    b, heads = q.shape[:2]
    rep = heads // k_cache.shape[1]
    key_len = int(lengths.max())
    keys = k_cache[:b, :, :key_len].float().repeat_interleave(rep, dim=1)  # [B, H, L, D]
    vals = v_cache[:b, :, :key_len].float().repeat_interleave(rep, dim=1)
    scores = torch.einsum("bhd,bhld->bhl", q.float(), keys) * scale
    dead = torch.arange(key_len, device=q.device)[None, :] >= lengths[:, None]
    scores = scores.masked_fill(dead[:, None, :], float("-inf"))
    return torch.einsum("bhl,bhld->bhd", torch.softmax(scores, dim=-1), vals)


def self_check(device: Any, dtype: Any, heads: int, kv_heads: int, head_dim: int) -> str | None:
    """Run the kernel once against `dense_reference` on a small case of this model's head
    layout; None when it agrees, else why not (the engine then keeps the dense path)."""
    import torch

    try:
        gen = torch.Generator(device="cpu").manual_seed(0)
        lengths = torch.tensor([1, 37, 130, 64, 5], dtype=torch.int32)
        cap = 192
        q = torch.randn(5, heads, head_dim, generator=gen).to(device=device, dtype=dtype)
        k = torch.randn(6, kv_heads, cap, head_dim, generator=gen).to(device=device, dtype=dtype)
        v = torch.randn(6, kv_heads, cap, head_dim, generator=gen).to(device=device, dtype=dtype)
        lengths = lengths.to(device)
        scale = head_dim ** -0.5
        got = decode_attention(q, k, v, lengths, scale, key_len=cap).float()
        want = dense_reference(q, k, v, lengths, scale)
        err = float((got - want).abs().max())
    except Exception as exc:  # noqa: BLE001 - a Triton that cannot compile here: keep the dense path
        return f"{type(exc).__name__}: {exc}"
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    return None if err <= tol else f"max |error| {err:.3g} above {tol}"


__all__ = ["available", "decode_attention", "dense_reference", "num_splits", "self_check"]

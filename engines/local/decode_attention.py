"""Decode attention over the slot KV cache, each row to its own length (flash-decoding, Triton).

A decode step of the embedded engine attends one query per row to that row's keys in its cache
slot. The dense path (`Decoder.decode`'s batched GEMMs) reads every row's keys up to the padded
key length of the longest row and masks the rest; at the batch sizes of RL rollouts the key/value
reads are most of a decode step's memory traffic (Qwen3-0.6B, 256 rows of ~450 positions: ~13 GB
of KV per step against 1.2 GB of weights), and rows of an RL batch differ widely in length. This
kernel reads only ``lengths[b]`` positions of row ``b``, and each of them once:

- **stage 1**, ``grid = (rows, kv heads, splits)``: one program per (row, key/value head, chunk
  of positions) serves the whole query-head group of that key/value head (grouped-query
  attention, as Hugging Face's ``repeat_kv`` groups: query heads ``kv_head * rep ...
  kv_head * rep + rep - 1``), so a key/value tile is read once for all its query heads. The
  scores are one ``tl.dot`` of the ``[group, head_dim]`` queries (the group padded to 16 rows,
  the smallest tensor-core tile) by a ``[head_dim, BLOCK_N]`` key tile, then an online softmax
  in float32 (base 2, the scale folded into one multiply) and a second ``tl.dot`` of the
  probabilities by the value tile. A chunk that starts past its row's length exits at once.
- **stage 2**, ``grid = (rows, heads)``: the row's live chunks are merged by their log-sum-exp
  (max, sum, unnormalised output of each) into the output. With one chunk per row, stage 1
  normalises and writes the output itself and there is no stage 2.

The number of chunks depends only on the batch and the key-length bucket (`num_splits`), never on
the lengths, and nothing reads a tensor on the host: a CUDA graph captured for one (batch, key
length) bucket replays it with any lengths in ``[1, key_len]``. In float32 the two dots run in
IEEE float32 (not TF32), so the engine's greedy tokens and logprobs match the dense path's to
float rounding; in bfloat16 the probabilities enter the second dot in bfloat16, as the dense
path's ``bmm`` takes them. Triton is optional: `available` says whether this path can run (CUDA
and an importable Triton); ``decode_attention = "auto"`` falls back to the dense path otherwise,
and after a self-check that compares the two on a small case (`self_check`). The kernel also runs
on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``), which the tests use.

History: the first kernel here (2026-12-02) ran one program per *query* head, which read each
grouped key/value head once per query head (twice for Qwen3's 16/8 heads) and measured no faster
than the dense path on an H200; hence this grouped layout.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from palaestra.engines.triton_device import available

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and the chunking policy (the defaults are what the engine uses; the
    benchmark `benchmarks/perf/decode_attention.py` sweeps them)."""

    block_n: int = 64  # positions per inner iteration (one key tile, one value tile)
    num_warps: int = 4
    num_stages: int = 2  # software pipelining depth of the tile loads
    #: chunks are added until stage 1 has about this many programs (an H200 has 132 SMs;
    #: with ragged rows, smaller chunks balance the long rows against the short ones)
    target_programs: int = 8192
    min_chunk: int = 128  # never chunks shorter than this: a chunk's merge costs ~1% of its read


DEFAULT = KernelConfig()


@functools.cache
def _kernel() -> tuple[Any, Any]:
    """(stage 1, stage 2), jitted on first use (under the interpreter if TRITON_INTERPRET=1).

    The kernels call Triton builtins and their own jitted helpers only (``tl.full``, not the
    jitted ``tl.zeros`` or ``tl.cdiv``): the interpreter patches the builtins but cannot call
    Triton's own jitted library functions when Triton was imported before ``TRITON_INTERPRET``
    was set (as in a test process that loaded a transformers model first). There the max and
    sum reductions go through ``tl.reduce`` with jitted combine functions (slower in the
    interpreter); everywhere else they are ``tl.max`` and ``tl.sum``."""
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    @triton.jit
    def _combine_max(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _combine_add(a, b):
        return a + b

    if isinstance(_combine_max, JITFunction) or not isinstance(tl.max, JITFunction):
        @triton.jit
        def _row_max(x, axis: tl.constexpr):
            return tl.max(x, axis=axis)

        @triton.jit
        def _row_sum(x, axis: tl.constexpr):
            return tl.sum(x, axis=axis)
    else:  # interpreting, with Triton's library jitted for the compiler
        @triton.jit
        def _row_max(x, axis: tl.constexpr):
            return tl.reduce(x, axis, _combine_max)

        @triton.jit
        def _row_sum(x, axis: tl.constexpr):
            return tl.reduce(x, axis, _combine_add)

    # the interpreter runs a kernel's source again over its module's globals (not its closure)
    globals().update(_combine_max=_combine_max, _combine_add=_combine_add, _row_max=_row_max,
                     _row_sum=_row_sum)

    @triton.jit
    def split_kernel(q_ptr, k_ptr, v_ptr, len_ptr, out_ptr, acc_ptr, max_ptr, sum_ptr,
                     qk_scale, chunk,
                     stride_qb, stride_qh, stride_kb, stride_kh, stride_kn,
                     stride_vb, stride_vh, stride_vn, stride_ob, stride_oh,
                     stride_ab, stride_ah, stride_as, stride_mb, stride_mh,
                     REP: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                     DP: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr,
                     PRECISION: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.load(len_ptr + row)
        start = split * chunk
        if start < length:  # chunks past the row's length do nothing
            end = tl.minimum(start + chunk, length)
            g = tl.arange(0, GROUP)
            dims = tl.arange(0, DP)
            heads = kv_head * REP + g
            hmask = (g < REP)[:, None] & (dims < D)[None, :]
            # a constant-true mask along the head dimension unless it is padded, so the tile
            # loads stay 16-byte vectors
            dmask = (dims < D)[None, :] if DP != D else tl.full([1, DP], 1, tl.int1)
            q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                        mask=hmask, other=0.0)
            k_base = k_ptr + row * stride_kb + kv_head * stride_kh
            v_base = v_ptr + row * stride_vb + kv_head * stride_vh
            run_max = tl.full([GROUP], float("-inf"), dtype=tl.float32)
            run_sum = tl.full([GROUP], 0.0, dtype=tl.float32)
            acc = tl.full([GROUP, DP], 0.0, dtype=tl.float32)
            for first in range(start, end, BLOCK):
                pos = first + tl.arange(0, BLOCK)
                live = pos < end
                keys = tl.load(k_base + pos[:, None] * stride_kn + dims[None, :],
                               mask=live[:, None] & dmask, other=0.0)
                # scores in base 2: qk_scale = softmax scale * log2(e)
                scores = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * qk_scale
                scores = tl.where(live[None, :], scores, float("-inf"))
                new_max = tl.maximum(run_max, _row_max(scores, 1))
                rescale = tl.exp2(run_max - new_max)
                probs = tl.exp2(scores - new_max[:, None])
                run_sum = run_sum * rescale + _row_sum(probs, 1)
                values = tl.load(v_base + pos[:, None] * stride_vn + dims[None, :],
                                 mask=live[:, None] & dmask, other=0.0)
                acc = acc * rescale[:, None] + tl.dot(probs.to(values.dtype), values,
                                                      input_precision=PRECISION)
                run_max = new_max
            if SINGLE:
                out = acc / run_sum[:, None]
                tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                         out.to(out_ptr.dtype.element_ty), mask=hmask)
            else:
                part = row * stride_ab + heads * stride_ah + split * stride_as
                tl.store(acc_ptr + part[:, None] + dims[None, :], acc, mask=hmask)
                stat = row * stride_mb + heads * stride_mh + split
                tl.store(max_ptr + stat, run_max, mask=g < REP)
                tl.store(sum_ptr + stat, run_sum, mask=g < REP)

    @triton.jit
    def merge_kernel(acc_ptr, max_ptr, sum_ptr, len_ptr, out_ptr, chunk,
                     stride_ab, stride_ah, stride_as, stride_mb, stride_mh,
                     stride_ob, stride_oh,
                     D: tl.constexpr, DP: tl.constexpr, SPLITS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        live_splits = (tl.load(len_ptr + row) + chunk - 1) // chunk
        s = tl.arange(0, SPLITS)
        dims = tl.arange(0, DP)
        live = s < live_splits
        stat = row * stride_mb + head * stride_mh + s
        maxes = tl.load(max_ptr + stat, mask=live, other=float("-inf"))
        sums = tl.load(sum_ptr + stat, mask=live, other=0.0)
        weights = tl.where(live, tl.exp2(maxes - _row_max(maxes, 0)), 0.0)
        part = row * stride_ab + head * stride_ah + s * stride_as
        acc = tl.load(acc_ptr + part[:, None] + dims[None, :],
                      mask=live[:, None] & (dims < D)[None, :], other=0.0)
        out = _row_sum(acc * weights[:, None], 0) / _row_sum(weights * sums, 0)
        tl.store(out_ptr + row * stride_ob + head * stride_oh + dims,
                 out.to(out_ptr.dtype.element_ty), mask=dims < D)

    return split_kernel, merge_kernel


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def num_splits(rows: int, kv_heads: int, key_len: int,
               config: KernelConfig = DEFAULT) -> tuple[int, int]:
    """(chunks per row, positions per chunk) for a batch and key-length bucket: enough stage-1
    programs for the GPU, chunks a multiple of the tile and never shorter than ``min_chunk``.
    Depends on no lengths, so a captured graph fits every batch of its bucket."""
    most = max(1, math.ceil(key_len / max(config.min_chunk, config.block_n)))
    splits = max(1, min(most, math.ceil(config.target_programs / max(1, rows * kv_heads))))
    chunk = math.ceil(math.ceil(key_len / splits) / config.block_n) * config.block_n
    return math.ceil(key_len / chunk), chunk


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     lengths: torch.Tensor, scale: float, key_len: int,
                     config: KernelConfig = DEFAULT) -> torch.Tensor:
    """Attention of one query per row to the first ``lengths[b]`` keys of slot ``b``.

    ``q`` ``[B, H, D]`` (any strides with a unit last one), ``k_cache``/``v_cache`` one layer of
    the slot cache ``[slots, kv_heads, capacity, D]`` (unit last stride; rows ``0..B-1`` read),
    ``lengths`` ``[B]`` int32 in ``[1, key_len]`` (on the device: never read on the host);
    ``key_len`` (the bucket, fixed for a captured graph) sets the chunking only. Returns a
    contiguous ``[B, H, D]`` in ``q``'s dtype.
    """
    import torch

    b, heads, d = q.shape
    kv_heads = k_cache.shape[1]
    rep = heads // kv_heads
    splits, chunk = num_splits(b, kv_heads, key_len, config)
    out = torch.empty(b, heads, d, device=q.device, dtype=q.dtype)
    single = splits == 1
    if single:  # stage 1 writes the output: the partial buffers are never touched
        acc = maxes = sums = out.new_empty(1, 1, 1, dtype=torch.float32)
    else:
        acc = torch.empty(b, heads, splits, d, device=q.device, dtype=torch.float32)
        maxes = torch.empty(b, heads, splits, device=q.device, dtype=torch.float32)
        sums = torch.empty_like(maxes)
    dp = max(16, _pow2(d))
    stage1, stage2 = _kernel()
    stage1[(b, kv_heads, splits)](
        q, k_cache, v_cache, lengths, out, acc, maxes, sums, scale * math.log2(math.e), chunk,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2), maxes.stride(0), maxes.stride(1),
        REP=rep, GROUP=max(16, _pow2(rep)), D=d, DP=dp, BLOCK=config.block_n, SINGLE=single,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if not single:
        stage2[(b, heads)](
            acc, maxes, sums, lengths, out, chunk,
            acc.stride(0), acc.stride(1), acc.stride(2), maxes.stride(0), maxes.stride(1),
            out.stride(0), out.stride(1), D=d, DP=dp, SPLITS=_pow2(splits), num_warps=4,
        )
    return out


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


def self_check(device: torch.device | str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> str | None:
    """Run the kernel once against `dense_reference` on a small case of this model's head
    layout, with one chunk per row and with several; None when it agrees, else why not (the
    engine then keeps the dense path)."""
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
        want = dense_reference(q, k, v, lengths, scale)
        err = 0.0
        for config in (DEFAULT, KernelConfig(target_programs=1),
                       KernelConfig(min_chunk=64, target_programs=1 << 20)):
            got = decode_attention(q, k, v, lengths, scale, key_len=cap, config=config).float()
            err = max(err, float((got - want).abs().max()))
    except Exception as exc:  # noqa: BLE001 - a Triton that cannot compile: keep the dense path
        return f"{type(exc).__name__}: {exc}"
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    return None if err <= tol else f"max |error| {err:.3g} above {tol}"


__all__ = ["DEFAULT", "KernelConfig", "available", "decode_attention", "dense_reference",
           "num_splits", "self_check"]

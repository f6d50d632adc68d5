"""Batch-invariant operations: each output row's bits depend on that row's inputs only.

Bitwise on-policy mode (``trainer.on_policy = "bitwise"``) needs the engine's forward of a token
(in a decode step of 1 or 200 rows, or in a prefill chunk, or from a prefix-cache hit) and the
trainer's forward of the same token (in a packed micro-batch) to give the same bits. The default
kernels do not: a float32 GEMM's row changes with the number of rows (on this repository's CPU,
``F.linear`` of 1-15 rows differs from the same rows inside a 300-row call, and at K = 1536 the
thread count changes it too), a reduction over one long row is split across threads when it is
the only row, and CPU elementwise kernels take a vectorised path for most elements and a scalar
path for a tail whose position depends on the tensor's size, with different ``sigmoid`` and
``rsqrt`` results (4% and 50% of random inputs differ in the last bit). So every reduction here
goes through one of two primitives whose order is fixed by construction, and elementwise work is
written with operations that are the same on both paths:

- `bmm_nt`: ``c[g] = a[g] @ b[g].T``. On CPU an exact product (`exact_product.exact_bmm_nt`): rows rounded
  to 24-bit fixed point and multiplied as integers in float64, where every order of the sums
  gives the same bits, so the host's BLAS (its kernel, instruction set, tile edges, threads)
  cannot change a row's result. On CUDA a Triton GEMM with fixed tiles
  (`palaestra.engines.bitwise.invariant_triton`).
- `row_sum`: a float32 sum over the last dim; on CPU torch's inner reduction with at least two
  rows (one row alone is split across threads), on CUDA one Triton program per row.
- `linear` is one `bmm_nt` of all its rows against the weight;
  RMSNorm, the log-softmax and attention take their sums from `row_sum` and `bmm_nt`; the
  elementwise parts use ``+ - * /``, ``sqrt``, ``exp`` and ``log`` only (correctly rounded, or
  equal on the vector and scalar paths: 0 differences in 10^8 random ``exp`` inputs), never
  ``sigmoid``, ``silu``, ``rsqrt`` or fused ``addcmul``/``addmm``.
- `attention` (causal, grouped-query) runs every query row against key blocks of `KEY_BLOCK`
  positions that start at position 0 of its sequence: the query rows of one (sequence, key/value
  head) fill tiles of `ROW_BLOCK` rows, scores and value sums are `bmm_nt` products of a tile by
  one key block, the row max is exact in any order, and the per-block value sums are added block
  after block. A block past a query's position contributes exact zeros, so a decode step that
  pads every row to the longest key length and a training forward of a short sequence agree.

The gradient of every operation is plain torch autograd (or, on CUDA, a plain-torch backward of
the Triton forward): the backward need not be invariant, only the forward that sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: query rows per attention tile
ROW_BLOCK = 32
#: key positions per attention block
KEY_BLOCK = 64


def _on_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def bmm_nt(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None,
           b_columns_apart: bool = False) -> torch.Tensor:
    """``c[g] = a[g] @ b[g].T`` for ``a [G, M, K]``, ``b [G, N, K]`` (b may be an expanded
    view), rounded once to ``out_dtype`` (default a's dtype); ``[G, M, N]``. Differentiable
    (a plain-torch backward). On CUDA the fixed-tile Triton GEMM; on CPU `exact_bmm_nt`, where
    ``b_columns_apart`` says that each of b's K columns must not change another's result (the
    keys of a value product, some of which a query does not see)."""
    if _on_cuda(a):
        from palaestra.engines.bitwise import invariant_triton

        return invariant_triton.bmm_nt(a, b, out_dtype)
    from palaestra.engines.bitwise.exact_product import exact_bmm_nt

    return exact_bmm_nt(a, b, a.dtype if out_dtype is None else out_dtype, b_columns_apart)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Float32 sums of the rows of ``x [M, N]`` in an order that does not depend on M."""
    import torch

    x = x.float()
    if _on_cuda(x):
        from palaestra.engines.bitwise import invariant_triton

        return invariant_triton.row_sum(x.contiguous())
    m = x.shape[0]
    if m == 1:  # a single row's sum is split across threads: give it a zero companion
        x = torch.cat((x, torch.zeros_like(x)))
    return x.contiguous().sum(dim=-1)[:m]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x [M, K]``, ``weight [N, K]``: one `bmm_nt` of all the
    rows, each row's result independent of the others (neither the Triton GEMM's tiles nor the
    CPU's exact product depend on the row count)."""
    out = bmm_nt(x.unsqueeze(0), weight.unsqueeze(0), out_dtype)[0]
    return out if bias is None else out + bias.to(out.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (any leading shape), in float32, the result in x's dtype:
    ``weight * (x / sqrt(mean(x^2) + eps))`` with the mean from `row_sum`."""
    import torch

    shape = x.shape
    xf = x.reshape(-1, shape[-1]).float()
    mean_sq = row_sum(xf * xf) / shape[-1]
    normed = xf / torch.sqrt(mean_sq + eps)[:, None]
    return (weight * normed.to(x.dtype)).reshape(shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` as ``gate / (1 + exp(-gate)) * up`` in float32 (torch's ``silu``
    and ``sigmoid`` differ between their vector and scalar paths on CPU)."""
    import torch

    g = gate.float()
    return (g / (1.0 + torch.exp(-g)) * up.float()).to(gate.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with the sign folded into ``sin_signed`` (two
    separately rounded products and a sum; no fused multiply-add)."""
    import torch

    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * sin_signed


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the last dim of float32 ``logits [M, V]``: ``z - log(sum(exp(z)))``
    with ``z = logits - max`` (the max is exact in any order, the sum is `row_sum`)."""
    import torch

    z = logits - logits.amax(dim=-1, keepdim=True)
    return z - torch.log(row_sum(torch.exp(z)))[:, None]


def divide_by_temperature(logits: torch.Tensor, temperatures: torch.Tensor | float
                          ) -> torch.Tensor:
    """Float32 ``logits [M, V] / T`` (T a float, or a tensor of one per row): always a true
    division by a float32 tensor on the logits' device. Both sides must divide the same way:
    CUDA divides by a Python number as a multiplication by its reciprocal, which rounds
    differently from dividing by the same value in a tensor (the engine's per-row ones)."""
    import torch

    t = torch.as_tensor(temperatures, dtype=torch.float32, device=logits.device)
    return logits.float() / (t[:, None] if t.dim() == 1 else t)


def _tiles(seq: torch.Tensor, num_heads: int, num_kv_heads: int
           ) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each (query, head) row goes: rows of one (sequence, key/value head) fill tiles of
    `ROW_BLOCK` rows in query order, query heads of a group next to each other.

    Returns (tiles, tile of each [N, H] row, row within its tile [N, H], the sequence of each
    tile [T], the key/value head of each tile [T]).
    """
    import torch

    dev = seq.device
    n = seq.shape[0]
    rep = num_heads // num_kv_heads
    seqs, inverse, counts = torch.unique(seq, return_inverse=True, return_counts=True)
    # rank of each query among its sequence's queries (stable: packed order)
    order = torch.argsort(inverse, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty(n, dtype=torch.long, device=dev)
    rank[order] = torch.arange(n, device=dev) - starts[inverse[order]]
    chunks = (counts * rep + ROW_BLOCK - 1) // ROW_BLOCK  # tiles per (sequence, kv head)
    base = torch.cumsum(chunks * num_kv_heads, 0) - chunks * num_kv_heads
    heads = torch.arange(num_heads, device=dev)
    group, within = heads // rep, heads % rep
    r = rank[:, None] * rep + within[None, :]  # [N, H] row inside its (sequence, kv head)
    tile = base[inverse][:, None] + group[None, :] * chunks[inverse][:, None] + r // ROW_BLOCK
    total = int((chunks * num_kv_heads).sum())
    tile_seq = torch.repeat_interleave(seqs, chunks * num_kv_heads)
    local = torch.arange(total, device=dev) - torch.repeat_interleave(base, chunks * num_kv_heads)
    tile_group = local // torch.repeat_interleave(chunks, chunks * num_kv_heads)
    return total, tile, r % ROW_BLOCK, tile_seq, tile_group


@dataclass
class AttentionPlan:
    """Where every (query, head) row of one forward goes in the attention tiles, and what each
    tile row sees: computed once per forward (`attention_plan`), used by every layer."""

    tiles: int
    tile: torch.Tensor  # [N, H] tile of each (query, head) row
    row: torch.Tensor  # [N, H] its row within the tile
    tile_seq: torch.Tensor  # [T] the sequence of each tile
    tile_group: torch.Tensor  # [T] its key/value head
    blocks: int  # key blocks of KEY_BLOCK positions (the longest query's)
    key_pos: torch.Tensor  # [J, BK] the position of each key slot
    visible: torch.Tensor  # [T, J, R, BK] whether a tile row sees a key slot


def attention_plan(seq: torch.Tensor, pos: torch.Tensor, num_heads: int, num_kv_heads: int
                   ) -> AttentionPlan:
    """The `AttentionPlan` of queries at ``pos [N]`` of sequences ``seq [N]``."""
    n = seq.shape[0]
    total, tile, row, tile_seq, tile_group = _tiles(seq, num_heads, num_kv_heads)
    blocks = int(pos.max()) // KEY_BLOCK + 1 if n else 1
    return _plan(total, tile, row, tile_seq, tile_group, pos, blocks)


def _plan(total: int, tile: torch.Tensor, row: torch.Tensor, tile_seq: torch.Tensor,
          tile_group: torch.Tensor, pos: torch.Tensor, blocks: int) -> AttentionPlan:
    """The `AttentionPlan` of tiles laid out as given: which key slot each tile row sees."""
    import torch

    n, heads = tile.shape
    # padding rows see position 0 only (finite, discarded)
    row_pos = torch.zeros(total, ROW_BLOCK, dtype=torch.long, device=pos.device).index_put(
        (tile, row), pos[:, None].expand(n, heads))
    key_pos = torch.arange(blocks * KEY_BLOCK, device=pos.device).view(blocks, KEY_BLOCK)
    visible = key_pos[None, :, None, :] <= row_pos[:, None, :, None]
    return AttentionPlan(total, tile, row, tile_seq, tile_group, blocks, key_pos, visible)


def decode_plan(positions: torch.Tensor, num_heads: int, num_kv_heads: int, key_len: int
                ) -> AttentionPlan:
    """The `AttentionPlan` of a decode step: query ``b`` is the one new token of sequence
    (slot) ``b`` at ``positions[b] < key_len``. The same tiles and rows as `attention_plan`
    gives those queries, with blocks up to ``key_len`` (the longest row's, or a CUDA graph's
    key-length bucket: blocks past a row's position add exact zeros); built from shapes and
    device tensors only, with no host sync, so a CUDA graph can capture it."""
    import torch

    b, dev = positions.shape[0], positions.device
    rep = num_heads // num_kv_heads
    chunks = -(-rep // ROW_BLOCK)  # tiles per (sequence, kv head)
    total = b * num_kv_heads * chunks
    heads = torch.arange(num_heads, device=dev)
    group, within = heads // rep, heads % rep
    per_seq = group * chunks + within // ROW_BLOCK  # [H] tile within the sequence's tiles
    tile = torch.arange(b, device=dev)[:, None] * (num_kv_heads * chunks) + per_seq[None, :]
    row = (within % ROW_BLOCK)[None, :].expand(b, num_heads)
    ids = torch.arange(total, device=dev)
    tile_seq = ids // (num_kv_heads * chunks)
    tile_group = (ids // chunks) % num_kv_heads
    blocks = max(1, -(-key_len // KEY_BLOCK))
    return _plan(total, tile, row, tile_seq, tile_group, positions, blocks)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: AttentionPlan,
              scale: float) -> torch.Tensor:
    """Causal grouped-query attention, batch-invariant: query ``i`` (``q [N, H, D]``) attends to
    positions ``0..pos[i]`` of sequence ``seq[i]`` of ``keys``/``values [S, Hkv, L, D]`` (a
    KV cache, or the packed sequences of a training batch), ``plan`` being
    ``attention_plan(seq, pos, ...)``. Positions a query does not see must hold finite numbers.
    Returns ``[N, H * D]`` in q's dtype. Under autograd the tiles are recomputed in the backward
    (checkpointed) instead of kept: a layer's gathered key/value tiles and scores are several
    times its activations."""
    import torch

    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, keys, values)):
        from torch.utils.checkpoint import checkpoint

        out: torch.Tensor = checkpoint(_attention, q, keys, values, plan, scale,
                                       use_reentrant=False)
        return out
    return _attention(q, keys, values, plan, scale)


def _attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: AttentionPlan,
               scale: float) -> torch.Tensor:
    import torch

    n, heads, d = q.shape
    p, total, blocks = plan, plan.tiles, plan.blocks
    q_tiles = q.new_zeros(total, ROW_BLOCK, d).index_put((p.tile, p.row), q)
    index = p.key_pos.clamp(max=keys.shape[2] - 1)
    k_tiles = keys[p.tile_seq[:, None, None], p.tile_group[:, None, None], index[None]]
    v_tiles = values[p.tile_seq[:, None, None], p.tile_group[:, None, None], index[None]]
    # [T, J, R, BK] scores of every tile against every key block of its sequence
    q_rep = q_tiles.unsqueeze(1).expand(total, blocks, ROW_BLOCK, d)
    scores = bmm_nt(q_rep.reshape(-1, ROW_BLOCK, d), k_tiles.reshape(-1, KEY_BLOCK, d),
                    torch.float32).view(total, blocks, ROW_BLOCK, KEY_BLOCK) * scale
    scores = scores.masked_fill(~p.visible, float("-inf"))
    peak = scores.amax(dim=(1, 3), keepdim=True)
    probs = torch.exp(scores - peak).to(v_tiles.dtype)
    # values with a column of ones: one product gives the weighted sum and the normaliser
    ones = v_tiles.new_ones(total, blocks, KEY_BLOCK, 1)
    v_aug = torch.cat((v_tiles, ones), dim=-1).transpose(2, 3)  # [T, J, D + 1, BK]
    parts = bmm_nt(probs.reshape(-1, ROW_BLOCK, KEY_BLOCK), v_aug.reshape(-1, d + 1, KEY_BLOCK),
                   torch.float32, b_columns_apart=True).view(total, blocks, ROW_BLOCK, d + 1)
    acc = parts[:, 0]
    for j in range(1, blocks):  # block after block: the order a decode step uses too
        acc = acc + parts[:, j]
    out = (acc[..., :d] / acc[..., d:]).to(q.dtype)  # [T, R, D]
    return out[p.tile, p.row].reshape(n, heads * d)


__all__ = [
    "KEY_BLOCK",
    "ROW_BLOCK",
    "AttentionPlan",
    "attention",
    "attention_plan",
    "bmm_nt",
    "decode_plan",
    "divide_by_temperature",
    "linear",
    "log_softmax",
    "rms_norm",
    "rope",
    "row_sum",
    "silu_mul",
]

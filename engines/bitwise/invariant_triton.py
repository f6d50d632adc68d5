"""Batch-invariant matmul and row sum on CUDA (Triton), for the bitwise on-policy mode.

The bitwise on-policy mode needs the inference engine's forward and the trainer's forward to
give bit-identical results for the same token, whatever else is in the batch. A GEMM through
cuBLAS does not: it picks its kernel, its tile shape and its split of the K reduction by the
problem's shape, so the same row of ``x @ W.T`` is summed in a different order (and rounds
differently) when the batch has 1 row, 16 rows or 4,096 rows. The kernels here are *batch
invariant*: the value of each output element depends only on its own inputs (its row of ``a``,
its row of ``b``, ``K``), never on how many rows or matrices are in the call, where the row sits
in it, or the shapes of the other operands. That holds because:

- **fixed tiles, no autotuning**: one compiled configuration (`BLOCK_M` x `BLOCK_N` x
  `BLOCK_K`, `NUM_WARPS`, `NUM_STAGES`, module constants) serves every call, so an element is
  always computed by the same instruction sequence, at the same place in a tile of the same
  layout; nothing is chosen from M, N or G;
- **one program per output tile, the whole K loop in it**: no split-K, no stream-K, no
  persistent scheduling; the K loop always starts at 0 and steps by `BLOCK_K`, so each element's
  partial sums are added in one fixed order. Rows past ``M`` (and columns past ``N``, depths past
  ``K``) are masked loads that read 0: they change no other element's arithmetic. ``M`` is not
  specialised on (``do_not_specialize``), so every batch size runs the same binary;
- **IEEE float32 dots**: with float32 inputs the tile products run as float32 FMAs
  (``input_precision="ieee"``, no TF32, whatever ``torch.backends.cuda.matmul.allow_tf32``
  says); bfloat16/float16 tiles go through the tensor cores with a float32 accumulator, which is
  position-independent too. The result is rounded once, to the output dtype, at the end;
- **row sums in one order**: `row_sum` gives each row one program that walks the columns in
  `ROW_SUM_BLOCK` steps into a float32 vector and reduces it once with ``tl.sum`` (a fixed tree
  for a fixed block and warp count), the same for every row whatever ``M``.

Both are differentiable (``torch.autograd.Function``: the forward is the kernel, the backward is
plain torch in float32: the trainer needs the forward's bits, not the backward's).

Triton is optional: the module imports without it, and `available` says whether the path can
run (CUDA and an importable Triton); the CPU path lives in
``palaestra.engines.bitwise.invariant``. The kernels also run on CPU tensors in Triton's
interpreter (``TRITON_INTERPRET=1`` set before Triton is imported), which the tests use; the
interpreter's dot is numpy's float32 matmul of the same fixed tiles, whose rounding is the host
BLAS's (it varies with the CPU and with a row's place in the tile), so on CPU the tests check the
tiling on data whose sums are exact, and only a GPU run shows the CUDA kernels' bits.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

# whether this path can run is the split-KV kernel's question too: CUDA and an importable Triton
from palaestra.engines.triton_device import available

if TYPE_CHECKING:
    import torch

#: the one matmul configuration (changing any of these changes every result's bits: the engine
#: and the trainer must run the same values)
#: 64 x 64 x 64, 4 warps, 3 stages: the best all-round of `benchmarks/perf/invariant_matmul.py
#: --sweep` on an H200 (Qwen3-0.6B's linears, one forward: 1.07 ms at 1-64 rows vs cuBLAS's
#: 0.62-0.85, 13.2 ms at 4,096 rows vs 7.1; the first choice, 64 x 64 x 32 in 2 stages, took
#: 2.2 and 15.6 ms)
BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 64
NUM_WARPS = 4
NUM_STAGES = 3
#: (BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES): the configuration every call runs
TILES = (BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES)
#: columns per step of `row_sum`, and its warps
ROW_SUM_BLOCK = 1024
ROW_SUM_WARPS = 4
#: CUDA's limit on grid dimensions 1 and 2 (N tiles and G): larger G is launched in chunks
_GRID_YZ_MAX = 65535


@functools.cache
def _kernels() -> tuple[Any, Any, bool]:
    """(matmul kernel, row-sum kernel, whether they are interpreted), jitted on first use (under
    the interpreter if ``TRITON_INTERPRET=1``).

    As in `decode_attention._kernel`, the kernels call Triton builtins and their own jitted
    helpers only (``tl.full``, not the jitted ``tl.zeros``): the interpreter cannot call
    Triton's own jitted library functions when Triton was imported before ``TRITON_INTERPRET``
    was set. There the sum goes through ``tl.reduce`` with a jitted combine function; everywhere
    else (the GPU included) it is ``tl.sum``. The interpreter's ``tl.dot`` of bfloat16 tiles
    multiplies their raw 16-bit patterns as integers (Triton 3.9), so interpreted, the matmul
    upcasts its 16-bit tiles to float32 first (exact: a product of two bf16/fp16 values fits a
    float32, as in the tensor cores' float32 accumulation)."""
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    @triton.jit
    def _combine_add(a, b):
        return a + b

    if isinstance(_combine_add, JITFunction) or not isinstance(tl.sum, JITFunction):
        @triton.jit
        def _vector_sum(x):
            return tl.sum(x, axis=0)
    else:  # interpreting, with Triton's library jitted for the compiler
        @triton.jit
        def _vector_sum(x):
            return tl.reduce(x, 0, _combine_add)

    # the interpreter runs a kernel's source again over its module's globals (not its closure)
    globals().update(_combine_add=_combine_add, _vector_sum=_vector_sum)

    # M (the batch size) is not specialised on: every M runs the same binary (and compiles once)
    @triton.jit(do_not_specialize=["M"])
    def bmm_nt_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                      stride_ag, stride_am, stride_ak,
                      stride_bg, stride_bn, stride_bk,
                      stride_cg, stride_cm, stride_cn,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        g = tl.program_id(2).to(tl.int64)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        rm = tl.arange(0, BLOCK_M)
        rn = tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        # the tile's origin in int64 (a [16384, 151936] logits tensor is past 2**31 elements);
        # the offsets inside a tile stay int32
        a_ptrs = (a_ptr + g * stride_ag + m0.to(tl.int64) * stride_am
                  + rm[:, None] * stride_am + rk[None, :] * stride_ak)
        b_ptrs = (b_ptr + g * stride_bg + n0.to(tl.int64) * stride_bn
                  + rk[:, None] * stride_bk + rn[None, :] * stride_bn)
        m_live = (m0 + rm) < M
        n_live = (n0 + rn) < N
        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
        # always from 0 in BLOCK_K steps: every element's partial sums in one fixed order
        for k0 in range(0, K, BLOCK_K):
            k_live = (k0 + rk) < K
            a = tl.load(a_ptrs, mask=m_live[:, None] & k_live[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_live[:, None] & n_live[None, :], other=0.0)
            if UPCAST:  # the interpreter's dot of 16-bit floats multiplies their raw bits
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        c_ptrs = (c_ptr + g * stride_cg + m0.to(tl.int64) * stride_cm
                  + rm[:, None] * stride_cm + (n0 + rn)[None, :] * stride_cn)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_live[:, None] & n_live[None, :])

    @triton.jit
    def row_sum_kernel(x_ptr, out_ptr, N, stride_xm, stride_xn, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        base = x_ptr + row * stride_xm
        acc = tl.full([BLOCK], 0.0, dtype=tl.float32)
        for start in range(0, N, BLOCK):
            live = (start + cols) < N
            x = tl.load(base + (start + cols) * stride_xn, mask=live, other=0.0)
            acc += x.to(tl.float32)
        tl.store(out_ptr + row, _vector_sum(acc))

    interpreted = not isinstance(bmm_nt_kernel, JITFunction)
    return bmm_nt_kernel, row_sum_kernel, interpreted


def _check_bmm_args(a: torch.Tensor, b: torch.Tensor) -> None:
    """Shapes, dtypes and devices `bmm_nt` takes; a clear error for anything else."""
    import torch

    if a.dim() != 3 or b.dim() != 3:
        raise ValueError(f"bmm_nt: a [G, M, K] and b [G, N, K], got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[2]:
        raise ValueError(f"bmm_nt: G and K must agree, got a {tuple(a.shape)} and b "
                         f"{tuple(b.shape)}")
    if a.dtype != b.dtype or a.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"bmm_nt: a and b of one dtype among float32/bfloat16/float16, got "
                        f"{a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"bmm_nt: a on {a.device}, b on {b.device}")


def _bmm_nt_forward(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype,
                    tiles: tuple[int, int, int, int, int] = TILES) -> torch.Tensor:
    """Launch the matmul kernel: ``c[g] = a[g] @ b[g].T`` into a new contiguous tensor.

    ``tiles`` is for the benchmark's sweep only (`benchmarks/perf/invariant_matmul.py`): each
    configuration is batch invariant on its own, but two of them need not give the same bits,
    so the engine and the trainer must both run `TILES`."""
    import torch

    block_m, block_n, block_k, num_warps, num_stages = tiles
    g, m, k = a.shape
    n = b.shape[1]
    c = torch.empty(g, m, n, device=a.device, dtype=out_dtype)
    if c.numel() == 0:
        return c
    n_tiles = -(-n // block_n)
    if n_tiles > _GRID_YZ_MAX:
        raise ValueError(f"bmm_nt: N={n} is more than {_GRID_YZ_MAX} tiles of {block_n}")
    kernel, _, interpreted = _kernels()
    precision = "ieee" if a.dtype == torch.float32 else "tf32"  # (ignored for 16-bit inputs)
    # G past the grid's limit goes in chunks: the chunk an element is in changes nothing of it
    for g0 in range(0, g, _GRID_YZ_MAX):
        g1 = min(g, g0 + _GRID_YZ_MAX)
        ac, bc, cc = a[g0:g1], b[g0:g1], c[g0:g1]
        kernel[(-(-m // block_m), n_tiles, g1 - g0)](
            ac, bc, cc, m, n, k,
            ac.stride(0), ac.stride(1), ac.stride(2),
            bc.stride(0), bc.stride(1), bc.stride(2),
            cc.stride(0), cc.stride(1), cc.stride(2),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
            UPCAST=interpreted and a.dtype != torch.float32,
            num_warps=num_warps, num_stages=num_stages,
        )
    return c


def _row_sum_forward(x: torch.Tensor) -> torch.Tensor:
    """Launch the row-sum kernel: float32 ``[M]``."""
    import torch

    m, n = x.shape
    out = torch.empty(m, device=x.device, dtype=torch.float32)
    if m == 0:
        return out
    _, kernel, _ = _kernels()
    kernel[(m,)](x, out, n, x.stride(0), x.stride(1), BLOCK=ROW_SUM_BLOCK,
                 num_warps=ROW_SUM_WARPS)
    return out


def _float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32; a stride-0 batch dimension (a weight expanded over G) stays a view, so
    the backward does not materialise G float32 copies of the weight."""
    if t.dim() == 3 and t.shape[0] > 1 and t.stride(0) == 0:
        return t[:1].float().expand(t.shape)
    return t.float()


def _shared_weight(b: torch.Tensor) -> torch.Tensor | None:
    """The 2-D ``w`` that ``b`` repeats over G (``b`` is a stride-0 view such as
    ``w[None].expand(G, N, K)``), as a differentiable tensor of ``b``'s base, or None.

    The gradient of such a ``w`` is the sum over G of the per-matrix gradients. Returned by the
    Function for ``b`` itself, that sum would be formed by the expand's own backward from a
    ``[G, N, K]`` gradient: G copies of the weight (128 x 0.6 GB in float32 for a 4,096-row
    lm_head in blocks of 32 rows). Differentiating with respect to ``w`` instead sums in one
    GEMM over all G * M rows, in float32, rounded once. ``w`` is found from ``b._base`` (the
    root of its views): a ``b`` whose root needs no gradient (a view of a plain tensor made to
    require one) keeps the per-matrix path, which is correct, only heavier."""
    base = b._base
    if (b.dim() != 3 or b.shape[0] < 2 or b.stride(0) != 0 or base is None
            or not base.requires_grad or base.dtype != b.dtype):
        return None
    shape, stride, offset = tuple(b.shape[1:]), tuple(b.stride()[1:]), b.storage_offset()
    if tuple(base.shape) == shape and base.stride() == stride \
            and base.storage_offset() == offset:
        return base  # the usual case: a weight (a parameter) unsqueezed and expanded
    return base.as_strided(shape, stride, offset)  # a slice of a fused parameter, etc.


@functools.cache
def _functions() -> tuple[Any, Any, Any]:
    """(BmmNT, BmmNTShared, RowSum): the autograd Functions, defined on first use (torch
    imported lazily)."""
    import torch

    class BmmNT(torch.autograd.Function):
        """``c = a @ b.transpose(1, 2)`` by the kernel; the backward in plain torch, float32."""

        @staticmethod
        def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
            ctx.save_for_backward(a, b)
            return _bmm_nt_forward(a, b, out_dtype)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, Any, None]:
            a, b = ctx.saved_tensors
            grad32 = grad.float()
            da = db = None
            if ctx.needs_input_grad[0]:
                da = torch.bmm(grad32, _float32(b)).to(a.dtype)
            if ctx.needs_input_grad[1]:
                # per-g gradients of b's shape (a stride-0 b that is no view of a weight, see
                # `_shared_weight`, gets them too: its expand's backward sums them over G)
                db = torch.bmm(grad32.transpose(1, 2), _float32(a)).to(b.dtype)
            return da, db, None

    class BmmNTShared(torch.autograd.Function):
        """``c[g] = a[g] @ w.T`` for one weight ``w [N, K]`` shared by every g: the forward is
        the kernel on ``w`` expanded over G (the bits of `BmmNT` on that view); the backward
        sums the weight's gradient over all G * M rows in one float32 GEMM."""

        @staticmethod
        def forward(ctx: Any, a: torch.Tensor, w: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
            ctx.save_for_backward(a, w)
            return _bmm_nt_forward(a, w.expand(a.shape[0], *w.shape), out_dtype)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, Any, None]:
            a, w = ctx.saved_tensors
            grad32 = grad.float()
            da = dw = None
            if ctx.needs_input_grad[0]:
                da = torch.matmul(grad32, w.float()).to(a.dtype)
            if ctx.needs_input_grad[1]:
                n, k = w.shape
                dw = (grad32.reshape(-1, n).t() @ a.float().reshape(-1, k)).to(w.dtype)
            return da, dw, None

    class RowSum(torch.autograd.Function):
        """``x.sum(1)`` by the kernel (float32); the backward broadcasts the gradient."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.x_shape = x.shape
            ctx.x_dtype = x.dtype
            return _row_sum_forward(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad[:, None].expand(ctx.x_shape).to(ctx.x_dtype)

    return BmmNT, BmmNTShared, RowSum


def _needs_grad(*tensors: torch.Tensor) -> bool:
    import torch

    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def bmm_nt(a: torch.Tensor, b: torch.Tensor,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Batch-invariant ``c[g] = a[g] @ b[g].T``: ``a`` ``[G, M, K]``, ``b`` ``[G, N, K]``.

    Any strides (``b`` may be a weight expanded over G with stride 0, or a transposed view);
    float32, bfloat16 or float16, one dtype for both. Accumulated in float32 (IEEE for float32
    inputs, never TF32), rounded once to ``out_dtype`` (default ``a.dtype``); returns a new
    contiguous ``[G, M, N]``. Differentiable. Each ``c[g, i, j]`` depends only on ``a[g, i]``,
    ``b[g, j]`` and ``K``: slicing rows off ``a`` or matrices off the batch leaves the others'
    bits unchanged. With a weight expanded over G (``w[None].expand(G, N, K)``), the gradient
    goes to ``w`` summed over every row in one float32 GEMM (see `_shared_weight`); for a
    shared weight a single matrix (``bmm_nt(x[None], w[None])``, any number of rows) is as
    invariant as blocks of rows and reads the weight once per row tile, not once per block."""
    _check_bmm_args(a, b)
    out_dtype = a.dtype if out_dtype is None else out_dtype
    if not _needs_grad(a, b):  # inference: no autograd node, nothing saved
        return _bmm_nt_forward(a, b, out_dtype)
    bmm_fn, shared_fn, _ = _functions()
    shared = _shared_weight(b) if b.requires_grad else None
    if shared is not None:  # a weight expanded over G: its gradient summed in one GEMM
        return shared_fn.apply(a, shared, out_dtype)
    return bmm_fn.apply(a, b, out_dtype)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Batch-invariant ``x.sum(dim=1)`` in float32 of a 2-D floating tensor ``[M, N]`` (any
    strides; a unit column stride reads fastest): each row is summed in one fixed order whatever
    ``M``. Returns a new float32 ``[M]``; differentiable."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"row_sum: a floating [M, N] tensor, got {x.dtype} {tuple(x.shape)}")
    if not _needs_grad(x):
        return _row_sum_forward(x)
    _, _, sum_fn = _functions()
    return sum_fn.apply(x)


__all__ = ["BLOCK_K", "BLOCK_M", "BLOCK_N", "NUM_STAGES", "NUM_WARPS", "ROW_SUM_BLOCK",
           "ROW_SUM_WARPS", "TILES", "available", "bmm_nt", "row_sum"]

"""The batch-invariant Triton matmul and row sum on a GPU: bit-identical rows whatever the batch.

Skipped without CUDA and Triton. At the shapes of a Qwen3-0.6B-like model (hidden 1024: the
fused qkv-like N = 3072, the vocabulary N = 151,936, attention score tiles N = 64 over many
matrices), in bfloat16 and float32, every row of a call with few rows equals the same row of a
call with 512 rows bit for bit (``torch.equal``), including rows that sit at another place of
their tile in the smaller call; one matrix called alone equals its slot in a batched call; a
weight expanded over G (stride 0) equals its contiguous copy and one flat call; row sums are
invariant across M; float32 results do not depend on the TF32 switch. Accuracy is checked
against ``torch.matmul`` in float32 (TF32 off), and the forward is checked to launch no cuBLAS
kernel (the profiler sees only the Triton kernel).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")]

DTYPES = [torch.bfloat16, torch.float32]
# (G, N, K): linear layers (one matrix, a weight of N rows) and attention score tiles
SHAPES = [(1, 3072, 1024), (1, 151936, 1024), (16, 64, 128), (16, 64, 1024)]
BIG_M = 512
SMALL_MS = [1, 2, 7, 16, 63, 64, 65, 100, 256]
# row ranges that put rows at other places of their 64-row tile than in the full call
SLICES = [(1, 2), (5, 70), (63, 129), (200, 201), (300, 512), (511, 512)]


def _inputs(g: int, m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(g, m, k, device="cuda", generator=gen).to(dtype)
    b = (torch.randn(g, n, k, device="cuda", generator=gen) / k ** 0.5).to(dtype)
    return a, b


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rows_are_bitwise_invariant_to_the_batch_size(shape: tuple[int, int, int],
                                                      dtype: torch.dtype) -> None:
    from palaestra.engines.bitwise.invariant_triton import bmm_nt

    g, n, k = shape
    a, b = _inputs(g, BIG_M, n, k, dtype)
    full = bmm_nt(a, b)
    for m in SMALL_MS:
        assert torch.equal(bmm_nt(a[:, :m], b), full[:, :m]), (shape, dtype, m)
    for start, end in SLICES:
        assert torch.equal(bmm_nt(a[:, start:end], b), full[:, start:end]), (start, end)
    # a non-contiguous a (rows strided by 2) changes nothing either
    assert torch.equal(bmm_nt(a[:, ::2], b), full[:, ::2])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [128, 1024])
def test_matrices_are_bitwise_invariant_to_the_batch_of_matrices(k: int,
                                                                 dtype: torch.dtype) -> None:
    from palaestra.engines.bitwise.invariant_triton import bmm_nt

    g, m, n = 48, 37, 64
    a, b = _inputs(g, m, n, k, dtype, seed=1)
    full = bmm_nt(a, b)
    for i in (0, 1, 17, 47):
        assert torch.equal(bmm_nt(a[i:i + 1], b[i:i + 1]), full[i:i + 1]), i
    assert torch.equal(bmm_nt(a[5:21], b[5:21]), full[5:21])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [3072, 151936])
def test_an_expanded_weight_gives_the_bits_of_its_copy_and_of_one_flat_call(
        n: int, dtype: torch.dtype) -> None:
    from palaestra.engines.bitwise.invariant_triton import bmm_nt

    g, m, k = 4, 96, 1024
    a, w = _inputs(1, g * m, n, k, dtype, seed=2)
    w = w[0]
    expanded = bmm_nt(a.view(g, m, k), w[None].expand(g, n, k))
    assert torch.equal(expanded, bmm_nt(a.view(g, m, k), w[None].expand(g, n, k).contiguous()))
    assert torch.equal(expanded.view(1, g * m, n), bmm_nt(a, w[None]))
    # a transposed view of the same weight (stride 1 along N) gives the same bits too
    w_t = w.t().contiguous().t()
    assert torch.equal(expanded.view(1, g * m, n), bmm_nt(a, w_t[None]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_accuracy_against_torch_matmul_in_float32(shape: tuple[int, int, int],
                                                  dtype: torch.dtype) -> None:
    from palaestra.engines.bitwise.invariant_triton import bmm_nt

    g, n, k = shape
    a, b = _inputs(g, 300, n, k, dtype, seed=3)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        want = torch.matmul(a.float(), b.float().transpose(1, 2))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    scale = float(want.abs().max())
    got32 = bmm_nt(a, b, out_dtype=torch.float32)
    assert float((got32 - want).abs().max()) < 1e-5 * scale * (1 if dtype == torch.float32
                                                                 else 10)
    got = bmm_nt(a, b)
    assert got.dtype == dtype and got.shape == (g, 300, n) and got.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7  # one rounding to the output dtype
    assert float((got.float() - want).abs().max()) < tol * scale


def test_float32_ignores_the_tf32_switch() -> None:
    """IEEE float32 dots: the bits are the same with TF32 allowed or not."""
    from palaestra.engines.bitwise.invariant_triton import bmm_nt

    a, b = _inputs(1, 64, 3072, 1024, torch.float32, seed=4)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        on = bmm_nt(a, b)
        torch.backends.cuda.matmul.allow_tf32 = False
        off = bmm_nt(a, b)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert torch.equal(on, off)


@pytest.mark.parametrize("n", [1024, 151936])
def test_row_sum_is_bitwise_invariant_and_accurate(n: int) -> None:
    from palaestra.engines.bitwise.invariant_triton import row_sum

    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(BIG_M, n, device="cuda", generator=gen)
    full = row_sum(x)
    for m in SMALL_MS:
        assert torch.equal(row_sum(x[:m]), full[:m]), m
    for start, end in SLICES:
        assert torch.equal(row_sum(x[start:end]), full[start:end]), (start, end)
    want = x.double().sum(1)
    assert float((full.double() - want).abs().max()) < 1e-6 * n ** 0.5 * 10


def test_forward_launches_no_cublas_kernel() -> None:
    """The forward runs the Triton kernel only: no aten matmul op, no cuBLAS/CUTLASS kernel."""
    from torch.profiler import ProfilerActivity, profile

    from palaestra.engines.bitwise.invariant_triton import bmm_nt, row_sum

    a, b = _inputs(1, 100, 3072, 1024, torch.bfloat16, seed=6)
    a32, b32 = _inputs(4, 100, 64, 128, torch.float32, seed=7)
    bmm_nt(a, b), bmm_nt(a32, b32), row_sum(a32[0])  # compile outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        bmm_nt(a, b)
        bmm_nt(a32, b32, out_dtype=torch.bfloat16)
        bmm_nt(a.expand(3, 100, 1024), b[0][None].expand(3, 3072, 1024))  # stride-0 views
        row_sum(a32[0])
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    lowered = [name.lower() for name in names]
    forbidden = ("gemm", "cublas", "cutlass", "xmma", "aten::mm", "aten::bmm", "aten::matmul",
                 "aten::addmm", "aten::linear", "aten::baddbmm")
    assert not [n for n, low in zip(names, lowered) if any(f in low for f in forbidden)], names
    assert any("bmm_nt_kernel" in name for name in names), names
    assert any("row_sum_kernel" in name for name in names), names


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradients_on_cuda_match_float64_autograd(dtype: torch.dtype) -> None:
    from palaestra.engines.bitwise.invariant_triton import bmm_nt, row_sum

    a, w = _inputs(1, 3 * 40, 512, 256, dtype, seed=8)
    a = a.view(3, 40, 256).requires_grad_()
    w = w[0].clone().requires_grad_()  # a leaf, as a parameter is
    up = torch.randn(3, 40, 512, device="cuda")
    c = bmm_nt(a, w[None].expand(3, 512, 256), out_dtype=torch.float32)
    assert type(c.grad_fn).__name__ == "BmmNTSharedBackward"
    (c * up).sum().backward()
    a64 = a.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    (torch.matmul(a64, w64.t()) * up.double()).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    for got, want in ((a.grad, a64.grad), (w.grad, w64.grad)):
        assert got.dtype == dtype and got.shape == want.shape
        assert float((got.double() - want).abs().max()) < tol * float(want.abs().max())
    x = torch.randn(7, 5000, device="cuda", requires_grad=True)
    up = torch.randn(7, device="cuda")
    (row_sum(x) * up).sum().backward()
    assert torch.equal(x.grad, up[:, None].expand(7, 5000))


def test_an_expanded_lm_head_backward_does_not_copy_the_weight_per_block() -> None:
    """4,096 rows in blocks of 32 against the 151,936-row lm_head (how `invariant.linear` calls
    it): the weight's gradient is one GEMM, not 128 per-block copies (80 GB in float32)."""
    from palaestra.engines.bitwise.invariant_triton import bmm_nt

    gen = torch.Generator(device="cuda").manual_seed(9)
    w = (torch.randn(151936, 1024, device="cuda", generator=gen) / 32).bfloat16()
    w.requires_grad_()
    x = torch.randn(128, 32, 1024, device="cuda", generator=gen).bfloat16().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    logits = bmm_nt(x, w[None].expand(128, *w.shape))
    logits.float().logsumexp(-1).sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    assert w.grad is not None and w.grad.shape == w.shape and x.grad.shape == x.shape
    assert peak < 20 * 2 ** 30, peak / 2 ** 30

"""The batch-invariant Triton matmul and row sum in Triton's CPU interpreter.

Runs in a subprocess with ``TRITON_INTERPRET=1`` set before Triton is imported (the interpreter
is chosen when a kernel is jitted), so it needs no GPU, only the triton package: without it the
tests skip. Shapes are small (the interpreter runs every program in Python) but cover the edges
the GPU sees: M, N and K off the tiles (M = 1, 5, 33, 70 across two row tiles; N = 7, 64, 100;
K = 16, 40), float32 and bfloat16, ``b`` as a transposed view, as a weight expanded over G with
stride 0, and ``a`` as a column slice. The interpreter's dot is numpy's matmul, so its rounding
is the host BLAS's (it differs between CPUs, and with a row's place in the tile): the invariance
checks (a row's values whatever the number of rows or matrices in the call, expanded and
contiguous ``b`` alike) run on dyadic data whose every partial sum is exact, so they check the
kernel's tiling and masking on any CPU. Bitwise invariance under rounding is the GPU test's
(tests/engines/test_invariant_triton_gpu.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.numerics  # the invariant kernels under Triton's interpreter

HAS_TRITON = importlib.util.find_spec("triton") is not None

SCRIPT = textwrap.dedent(
    """
    import json
    import torch
    torch.set_num_threads(1)
    from palaestra.engines.bitwise.invariant_triton import bmm_nt, row_sum

    gen = torch.Generator().manual_seed(0)
    DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    out = {"accuracy": [], "invariance": [], "row_sum": [], "grads": []}

    def rel_err(got, want):
        # max |error| over the reference's scale (the rounding of the output is relative)
        return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))

    def ref(a, b):
        return a.double() @ b.double().transpose(1, 2)

    # accuracy against float64, every shape on and off the tiles, b in three layouts
    for dname, dtype in DTYPES.items():
        for m in (1, 5, 33):
            for n in (7, 64, 100):
                for k in (16, 40):
                    a = torch.randn(2, m, k, generator=gen).to(dtype)
                    layouts = {
                        "contiguous": torch.randn(2, n, k, generator=gen).to(dtype),
                        "transposed": torch.randn(2, k, n, generator=gen).to(dtype)
                        .transpose(1, 2),
                        "expanded": torch.randn(n, k, generator=gen).to(dtype)[None]
                        .expand(2, n, k),
                    }
                    for layout, b in layouts.items():
                        c = bmm_nt(a, b)
                        out["accuracy"].append({
                            "dtype": dname, "m": m, "n": n, "k": k, "b": layout,
                            "out_dtype": str(c.dtype), "shape": list(c.shape),
                            "contiguous": c.is_contiguous(), "rel_err": rel_err(c, ref(a, b))})
        # a strided a (a column slice) and a float32 output of 16-bit inputs
        a = torch.randn(3, 9, 48, generator=gen).to(dtype)[:, :, 4:44]
        b = torch.randn(3, 11, 40, generator=gen).to(dtype)
        c = bmm_nt(a, b, out_dtype=torch.float32)
        out["accuracy"].append({
            "dtype": dname, "m": 9, "n": 11, "k": 40, "b": "contiguous, a sliced",
            "out_dtype": str(c.dtype), "shape": list(c.shape), "contiguous": c.is_contiguous(),
            "rel_err": rel_err(c, ref(a, b)), "want_out_dtype": "torch.float32"})

    # invariance: a row's values whatever the other rows and matrices of the call. The
    # interpreter's tl.dot is numpy's matmul (the host's BLAS), whose summation order depends on
    # the CPU's kernel and on where a row sits in the tile (an AVX2-only OpenBLAS gives other
    # bits for a row moved in its tile), so random data would measure the host's BLAS, not this
    # kernel. Dyadic data instead (multiples of 1/16 in [-2, 2]: exact in bfloat16, every
    # product a multiple of 1/256, every partial sum over K = 40 far below 2 ** 24 / 256) makes
    # every summation order give the exact sum, so equal bits here prove the kernel's tiling:
    # each row and matrix lands in its own place, masked rows, columns and depths read 0 and
    # leak into nothing, a stride-0 weight reads the right rows. Bitwise invariance under
    # rounding is the GPU test's (tests/engines/test_invariant_triton_gpu.py).
    def dyadic(*shape):
        return torch.randint(-32, 33, shape, generator=gen).float() / 16

    for dname, dtype in DTYPES.items():
        g, m, n, k = 5, 70, 100, 40
        a = dyadic(g, m, k).to(dtype)
        w = dyadic(n, k).to(dtype)
        b = dyadic(g, n, k).to(dtype)
        full = bmm_nt(a, b)
        # the float32 result is the exact sum (the interpreter's cast of a float32 tile to
        # bfloat16 truncates where the GPU rounds to nearest, so exactness is checked before
        # the cast; the bfloat16 rows below compare casts of equal exact sums)
        checks = {"full_is_exact": torch.equal(bmm_nt(a, b, out_dtype=torch.float32),
                                               ref(a, b).float())}
        for rows in (1, 5, 33, 64, 65):
            checks[f"rows_0_{rows}"] = torch.equal(bmm_nt(a[:, :rows], b), full[:, :rows])
        # rows moved to other places of the tile: the last 6 rows called alone
        checks["rows_64_70_alone"] = torch.equal(bmm_nt(a[:, 64:], b), full[:, 64:])
        checks["rows_3_9_alone"] = torch.equal(bmm_nt(a[:, 3:9], b), full[:, 3:9])
        checks["g1_vs_g5"] = all(torch.equal(bmm_nt(a[i:i + 1], b[i:i + 1]), full[i:i + 1])
                                 for i in range(g))
        expanded = bmm_nt(a, w[None].expand(g, n, k))
        checks["expanded_is_exact"] = torch.equal(
            bmm_nt(a, w[None].expand(g, n, k), out_dtype=torch.float32),
            ref(a, w[None].expand(g, n, k)).float())
        checks["expanded_vs_contiguous_b"] = torch.equal(
            expanded, bmm_nt(a, w[None].expand(g, n, k).contiguous()))
        checks["expanded_vs_one_flat_call"] = torch.equal(
            expanded.reshape(1, g * m, n), bmm_nt(a.reshape(1, g * m, k), w[None]))
        checks["transposed_vs_contiguous_b"] = torch.equal(
            full, bmm_nt(a, b.transpose(1, 2).contiguous().transpose(1, 2)))
        out["invariance"].append({"dtype": dname, **checks})

    # row_sum: accuracy and invariance across M, contiguous and strided
    x = torch.randn(9, 2600, generator=gen)
    for name, t in (("contiguous", x), ("column_slice", x[:, 100:2600]),
                    ("strided_columns", x[:, ::2]), ("bfloat16", x.bfloat16())):
        s = row_sum(t)
        want = t.double().sum(1)
        out["row_sum"].append({
            "layout": name, "dtype": str(s.dtype), "shape": list(s.shape),
            "err": float((s.double() - want).abs().max()),
            "invariant": all(torch.equal(row_sum(t[:m]), s[:m]) for m in (1, 4, 8)),
            "row_alone": all(torch.equal(row_sum(t[i:i + 1]), s[i:i + 1]) for i in range(9))})

    # gradients against torch autograd of the plain formula in float64; b as its own tensor,
    # as a weight expanded over G (the weight's gradient summed in one GEMM), as a slice of a
    # fused weight expanded over G, and as a stride-0 leaf (per-matrix gradients)
    for dname, dtype in DTYPES.items():
        for layout in ("contiguous", "expanded", "fused_slice", "stride0_leaf"):
            a = torch.randn(3, 6, 20, generator=gen).to(dtype).requires_grad_()
            if layout == "contiguous":
                w = torch.randn(3, 10, 20, generator=gen).to(dtype).requires_grad_()
                b = w
            elif layout == "expanded":
                w = torch.randn(10, 20, generator=gen).to(dtype).requires_grad_()
                b = w[None].expand(3, 10, 20)
            elif layout == "fused_slice":
                w = torch.randn(16, 20, generator=gen).to(dtype).requires_grad_()
                b = w[4:14][None].expand(3, 10, 20)
            else:
                base = torch.randn(10, 20, generator=gen).to(dtype)
                w = base[None].expand(3, 10, 20).detach().requires_grad_()
                b = w
            up = torch.randn(3, 6, 10, generator=gen)
            c = bmm_nt(a, b, out_dtype=torch.float32)
            with torch.no_grad():
                same_bits = torch.equal(c, bmm_nt(a, b, out_dtype=torch.float32))
            (c * up).sum().backward()
            a64 = a.detach().double().requires_grad_()
            w64 = w.detach().double().requires_grad_()
            b64 = {"expanded": lambda: w64[None].expand(3, 10, 20),
                   "fused_slice": lambda: w64[4:14][None].expand(3, 10, 20)}.get(
                       layout, lambda: w64)()
            (ref(a64, b64) * up.double()).sum().backward()
            out["grads"].append({
                "fn": "bmm_nt", "dtype": dname, "b": layout, "node": type(c.grad_fn).__name__,
                "same_bits_as_no_grad": same_bits,
                "grad_dtypes": [str(a.grad.dtype), str(w.grad.dtype)],
                "grad_shapes": [list(a.grad.shape), list(w.grad.shape)],
                "a_err": rel_err(a.grad, a64.grad), "b_err": rel_err(w.grad, w64.grad)})
    x = torch.randn(5, 1500, generator=gen, requires_grad=True)
    up = torch.randn(5, generator=gen)
    (row_sum(x) * up).sum().backward()
    out["grads"].append({"fn": "row_sum", "dtype": "float32", "b": "-",
                         "node": type(row_sum(x).grad_fn).__name__,
                         "grad_dtypes": [str(x.grad.dtype)], "grad_shapes": [list(x.grad.shape)],
                         "a_err": float((x.grad - up[:, None]).abs().max()), "b_err": 0.0})
    print(json.dumps(out))
    """
)

TOL = {"float32": 1e-6, "bfloat16": 2 ** -7}  # relative to the output's scale


@pytest.fixture(scope="module")
def interpreted() -> dict:
    if not HAS_TRITON:
        pytest.skip("needs the triton package (pip install triton): its interpreter runs on CPU")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_bmm_nt_matches_float64_on_and_off_the_tiles(interpreted: dict) -> None:
    rows = interpreted["accuracy"]
    assert len(rows) == 2 * (3 * 3 * 2 * 3 + 1)
    for r in rows:
        want_dtype = r.get("want_out_dtype", f"torch.{r['dtype']}")
        assert r["out_dtype"] == want_dtype, r
        assert r["contiguous"] and r["shape"][1:] == [r["m"], r["n"]], r
        assert r["rel_err"] < TOL[r["dtype"]], r


def test_bmm_nt_rows_and_matrices_are_invariant_to_the_rest_of_the_call(
        interpreted: dict) -> None:
    assert [r["dtype"] for r in interpreted["invariance"]] == ["float32", "bfloat16"]
    for r in interpreted["invariance"]:
        failed = [name for name, ok in r.items() if ok is False]
        assert not failed, r


def test_row_sum_matches_and_is_invariant(interpreted: dict) -> None:
    assert len(interpreted["row_sum"]) == 4
    for r in interpreted["row_sum"]:
        assert r["dtype"] == "torch.float32" and r["shape"] == [9], r
        assert r["err"] < 1e-3, r  # sums of ~2,600 N(0, 1) in float32
        assert r["invariant"] and r["row_alone"], r


def test_gradients_match_autograd_of_the_plain_formula(interpreted: dict) -> None:
    grads = interpreted["grads"]
    assert len(grads) == 9
    # the shapes of the weights (w) whose gradients are checked
    want_w = {"contiguous": [3, 10, 20], "expanded": [10, 20], "fused_slice": [16, 20],
              "stride0_leaf": [3, 10, 20]}
    for r in grads:
        if r["fn"] == "row_sum":
            assert r["node"] == "RowSumBackward", r
            assert r["grad_shapes"] == [[5, 1500]] and r["a_err"] == 0.0, r
            continue
        # a weight expanded over G goes to the Function that sums its gradient in one GEMM
        shared = r["b"] in ("expanded", "fused_slice")
        assert r["node"] == ("BmmNTSharedBackward" if shared else "BmmNTBackward"), r
        assert r["same_bits_as_no_grad"], r
        dtype = f"torch.{r['dtype']}"
        assert r["grad_dtypes"] == [dtype, dtype], r
        assert r["grad_shapes"] == [[3, 6, 20], want_w[r["b"]]], r
        assert r["a_err"] < TOL[r["dtype"]] and r["b_err"] < TOL[r["dtype"]], r


def test_module_imports_without_triton_and_refuses_cpu() -> None:
    """No import-time dependency on triton (the CPU path must not need it)."""
    code = ("import sys; import palaestra.engines.bitwise.invariant_triton as m; "
            "assert 'triton' not in sys.modules; assert not m.available('cpu'); print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-4000:]

"""The CPU product of bitwise mode (`palaestra.engines.bitwise.exact_product`): a row's bits do
not depend on the rows, matrices or key columns beside it, whatever the host's BLAS does.

The premise is built: the product sums integers below 2**53 in float64, so any BLAS order gives
the same bits; these tests check that the construction holds (row position, batch size, thread
count, the columns a query does not see) and that it is the product (to float32 rounding)."""

from __future__ import annotations

import pytest
import torch

from palaestra.engines.bitwise.exact_product import exact_bmm_nt

pytestmark = pytest.mark.numerics


def _inputs(g: int = 3, m: int = 37, n: int = 29, k: int = 300, seed: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(g, m, k, generator=gen) * torch.logspace(-3, 2, k)  # wide exponent range
    return a, torch.randn(g, n, k, generator=gen)


def test_a_row_has_the_same_bits_wherever_it_sits() -> None:
    a, b = _inputs()
    whole = exact_bmm_nt(a, b, torch.float32)
    perm = torch.randperm(a.shape[1], generator=torch.Generator().manual_seed(1))
    for threads in (1, 2):
        torch.set_num_threads(threads)
        assert torch.equal(exact_bmm_nt(a[:, perm], b, torch.float32), whole[:, perm])
        assert torch.equal(exact_bmm_nt(a[1:2, 5:6], b[1:2], torch.float32), whole[1:2, 5:6])
        assert torch.equal(exact_bmm_nt(a[:, 7:30], b[:, 3:4], torch.float32), whole[:, 7:30, 3:4])
    torch.set_num_threads(1)


def test_it_is_the_product_to_float32_rounding() -> None:
    a, b = _inputs()
    want = torch.bmm(a.double(), b.double().transpose(1, 2))
    got = exact_bmm_nt(a, b, torch.float32).double()
    scale = torch.bmm(a.double().abs(), b.double().abs().transpose(1, 2))
    # each row rounded to 24 bits at its largest magnitude, then the result to float32: a few
    # 2**-24 of the scale (a float32 GEMM of K = 300 is allowed ~K * 2**-24 of it)
    assert float(((got - want).abs() / scale).max()) < 1e-6
    assert exact_bmm_nt(a.bfloat16(), b.bfloat16(), torch.float32).dtype == torch.float32


def test_columns_apart_ignore_the_keys_a_row_does_not_weigh() -> None:
    probs, values = _inputs(g=2, m=8, n=17, k=64, seed=2)
    probs = probs.abs()
    probs[:, :, 40:] = 0.0  # keys 40.. unseen by every row
    other = values.clone()
    other[:, :, 40:] = torch.randn(2, 17, 24) * 1e4  # what a cache holds there: anything finite
    one = exact_bmm_nt(probs, values, torch.float32, b_columns_apart=True)
    two = exact_bmm_nt(probs, other, torch.float32, b_columns_apart=True)
    assert torch.equal(one, two)
    # the premise: with one scale per row of b, those keys do move the rounding
    assert not torch.equal(exact_bmm_nt(probs, values, torch.float32),
                           exact_bmm_nt(probs, other, torch.float32))
    want = torch.bmm(probs.double(), values.double().transpose(1, 2))
    torch.testing.assert_close(one.double(), want, rtol=1e-6, atol=1e-6)


def test_the_gradient_is_the_plain_products() -> None:
    a, b = _inputs(g=2, m=5, n=4, k=16)
    a.requires_grad_(True)
    b.requires_grad_(True)
    grad = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(4))
    ga, gb = torch.autograd.grad(exact_bmm_nt(a, b, torch.float32), (a, b), grad)
    assert torch.equal(ga, torch.bmm(grad, b.detach()))
    assert torch.equal(gb, torch.bmm(grad.transpose(1, 2), a.detach()))

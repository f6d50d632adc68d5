"""A CPU matrix product whose bits no BLAS can change: the batch-invariant GEMM of bitwise mode.

A float32 GEMM's bits depend on the order of its sums, which the host's BLAS picks by CPU,
instruction set, shape, thread count and a row's position in its tile (under MKL's AVX2 kernels a
row's result changes with its position in a batched matrix). `exact_bmm_nt` rounds every row to
a 24-bit fixed point, multiplies the integer halves in float64 GEMMs whose sums of integers below
2**53 are exact in any order, and puts the halves together with the same elementwise float64
operations everywhere: each ``c[g, i, j]`` is a fixed function of ``a[g, i]`` and ``b[g, j]``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def exact_bmm_nt(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype,
                 b_columns_apart: bool = False) -> torch.Tensor:
    """``c[g] = a[g] @ b[g].T`` for ``a [G, M, K]``, ``b [G, N, K]``, exactly reproducible on
    any CPU (`_exact_forward`), rounded once to ``out_dtype``. Differentiable: the backward is
    two plain GEMMs (only the forward that sampled must be invariant)."""
    if not (a.requires_grad or b.requires_grad):
        return _exact_forward(a, b, out_dtype, b_columns_apart)
    return _exact_bmm_function().apply(a, b, out_dtype, b_columns_apart)


#: bits of a row's fixed-point mantissa, and of each of its two halves
_MANTISSA_BITS = 24
_HALF_BITS = 12


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """``2.0 ** exponent`` in float64, exactly: the exponent written into the bits (a library
    ``pow`` or ``ldexp`` may round)."""
    import torch

    return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)


def _fixed_point_halves(x: torch.Tensor, exponent: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row of ``x [..., K]`` as integers: ``x ~= (hi * 2**12 + lo) * scale``, with the row
    rounded to a 24-bit fixed point relative to ``2**exponent`` (``[..., 1]``, by default that
    of the row's largest magnitude: float32's precision), ``|hi| <= 2**12``, ``|lo| <= 2**11``
    and ``scale [..., 1]`` a power of two; all float64."""
    import torch

    x64 = x.double()
    if exponent is None:  # |x| < 2**exponent
        _, exponent = torch.frexp(x64.abs().amax(dim=-1, keepdim=True))
    q = torch.round(x64 * _power_of_two(_MANTISSA_BITS - exponent))
    hi = torch.round(q * 2.0 ** -_HALF_BITS)
    return hi, q - hi * 2.0 ** _HALF_BITS, _power_of_two(exponent - _MANTISSA_BITS)


def _exact_forward(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype,
                   b_columns_apart: bool = False) -> torch.Tensor:
    """The product (see the module's docstring). Rounding each row to 24 bits at its largest
    magnitude costs what a float32 GEMM's own rounding does; the three float64 GEMMs cost ~8
    float32 ones.

    A row of ``b`` shares one scale over its K columns, so a column's magnitude moves the
    rounding of the others. Where that must not happen (``b_columns_apart``: the value product
    of attention, whose K columns are keys, those past a query's position differing between a
    decode step and a training forward), each column of ``b`` gets its own power-of-two scale
    over its N rows, moved exactly onto the matching column of ``a`` (a key a query does not
    see has a zero weight there, so it moves nothing), and b's rows share one fixed scale."""
    import torch

    if a.shape[-1] >= 2 ** 29:
        raise ValueError(f"exact_bmm_nt: K = {a.shape[-1]} must be below 2**29")
    b_exponent = None
    if b_columns_apart:  # every column below 1 in magnitude, b's rows on one fixed scale
        _, exponent = torch.frexp(b.double().abs().amax(dim=-2, keepdim=True))  # [G, 1, K]
        a = a.double() * _power_of_two(exponent)
        b = b.double() * _power_of_two(-exponent)
        b_exponent = torch.zeros(*b.shape[:-1], 1, dtype=torch.int64, device=b.device)
    a_hi, a_lo, a_scale = _fixed_point_halves(a)
    b_hi, b_lo, b_scale = _fixed_point_halves(b, b_exponent)
    high = torch.bmm(a_hi, b_hi.transpose(1, 2))
    middle = torch.bmm(torch.cat((a_hi, a_lo), -1), torch.cat((b_lo, b_hi), -1).transpose(1, 2))
    low = torch.bmm(a_lo, b_lo.transpose(1, 2))
    total = (high * 2.0 ** (2 * _HALF_BITS) + middle * 2.0 ** _HALF_BITS) + low
    return (total * (a_scale * b_scale.transpose(1, 2))).to(out_dtype)


@functools.cache
def _exact_bmm_function() -> Any:
    """`exact_bmm_nt` as an autograd function: the backward is two plain GEMMs (the forward's
    rounding to integers has no useful gradient; only the forward that sampled must be
    invariant)."""
    import torch

    class ExactBmmNT(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype,
                    b_columns_apart: bool) -> torch.Tensor:
            ctx.save_for_backward(a, b)
            return _exact_forward(a, b, out_dtype, b_columns_apart)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
            a, b = ctx.saved_tensors
            grad_a = torch.bmm(grad.to(b.dtype), b) if ctx.needs_input_grad[0] else None
            grad_b = (torch.bmm(grad.to(a.dtype).transpose(1, 2), a)
                      if ctx.needs_input_grad[1] else None)
            return grad_a, grad_b, None, None

    return ExactBmmNT


__all__ = ["exact_bmm_nt"]

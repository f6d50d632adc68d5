"""SDPA core attention on Megatron layouts: padded ("sbhd") and packed ("thd") sequences."""

from __future__ import annotations

import pytest
import torch

from palaestra.trainers.attention import sdpa_bshd, sdpa_thd


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one sequence, q [s, hq, d], k/v [s, hkv, d] -> [s, hq * d], float64."""
    q, k, v = (t.double() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    s = q.shape[0]
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(s, -1)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_bshd_matches_naive_causal_gqa(hq, hkv):
    g = torch.Generator().manual_seed(0)
    s, b, d = 7, 3, 8
    q = torch.randn(s, b, hq, d, generator=g)
    k = torch.randn(s, b, hkv, d, generator=g)
    v = torch.randn(s, b, hkv, d, generator=g)
    out = sdpa_bshd(q, k, v, scale=0.3)
    assert out.shape == (s, b, hq * d)
    for i in range(b):
        ref = _naive(q[:, i], k[:, i], v[:, i], 0.3)
        assert torch.allclose(out[:, i].double(), ref, atol=1e-5)


def test_thd_never_attends_across_packed_sequences():
    g = torch.Generator().manual_seed(1)
    lengths = [5, 1, 9, 3]
    t, hq, hkv, d = sum(lengths), 4, 2, 8
    q = torch.randn(t, hq, d, generator=g, requires_grad=True)
    k = torch.randn(t, hkv, d, generator=g, requires_grad=True)
    v = torch.randn(t, hkv, d, generator=g, requires_grad=True)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    out = sdpa_thd(q, k, v, cu, max(lengths), scale=d**-0.5)
    assert out.shape == (t, hq * d)
    start = 0
    for n in lengths:
        ref = _naive(q[start : start + n], k[start : start + n], v[start : start + n], d**-0.5)
        assert torch.allclose(out[start : start + n].double(), ref, atol=1e-5)
        start += n
    # gradients flow to every input and stay inside each sequence
    out[:5].sum().backward()
    assert q.grad[5:].abs().sum() == 0 and k.grad[5:].abs().sum() == 0
    assert q.grad[:5].abs().sum() > 0


def test_thd_single_sequence_equals_bshd():
    g = torch.Generator().manual_seed(2)
    s, hq, hkv, d = 11, 4, 2, 8
    q, k, v = (torch.randn(s, h, d, generator=g) for h in (hq, hkv, hkv))
    packed = sdpa_thd(q, k, v, torch.tensor([0, s], dtype=torch.int32), s)
    padded = sdpa_bshd(q[:, None], k[:, None], v[:, None])[:, 0]
    assert torch.allclose(packed, padded, atol=1e-6)


def test_varlen_forced_off_cuda_is_refused_or_unavailable():
    q = torch.randn(4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(RuntimeError):
        sdpa_thd(q, q, q, cu, 4, use_varlen=True)  # CPU: the flash varlen kernel cannot run


def test_packed_attention_mode_picks_per_sequence_only_for_short_packs():
    from palaestra.trainers.attention import PER_SEQUENCE_MAX, use_per_sequence

    assert use_per_sequence("auto", 1) and use_per_sequence("auto", PER_SEQUENCE_MAX)
    assert not use_per_sequence("auto", PER_SEQUENCE_MAX + 1)
    assert use_per_sequence("per_sequence", 100) and not use_per_sequence("varlen", 1)

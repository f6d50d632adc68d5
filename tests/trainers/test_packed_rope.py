"""The one-rotation route of megatron's THD RoPE (`trainers.megatron.packed_rope`): bit for bit
what megatron's per-sequence exact-mapping loop gives, and megatron's own path everywhere else.
Needs megatron-core (Python >= 3.12: the GPU machine); pure tensor math, so CPU or CUDA."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")


class OneRank:
    """A context-parallel group of one rank (what megatron asks of ``cp_group``)."""

    def __init__(self, size: int = 1) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


def _packed(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 17, 64, 3]
    total = sum(lengths)
    t = torch.randn(total, 4, 32, generator=g).to(device, torch.bfloat16)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32).to(device)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    inv = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32))
    table = torch.outer(torch.arange(128).float(), inv)
    table = torch.cat([table, table], -1)[:, None, None, :].to(device)  # [max_len, 1, 1, dim]
    return t, cu, table, positions


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_one_rotation_equals_megatrons_per_sequence_loop(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from megatron.core.models.common.embeddings import rope_utils

    from palaestra.trainers.megatron import packed_rope

    t, cu, table, positions = _packed(device)
    original = rope_utils._apply_rotary_pos_emb_thd
    if getattr(original, "palaestra_one_rotation", False):
        pytest.skip("megatron's function was already wrapped in this process")
    want_exact = original(t, cu, table[positions], cp_group=OneRank())
    want_legacy = original(t, cu, table, cp_group=OneRank())
    packed_rope._route_exact_mapping_to_one_rotation()
    try:
        fast = rope_utils._apply_rotary_pos_emb_thd
        assert fast is not original and fast.palaestra_one_rotation
        assert torch.equal(fast(t, cu, table[positions], cp_group=OneRank()), want_exact)
        # a max-length table (megatron's legacy per-sequence mapping) is megatron's own path
        assert torch.equal(fast(t, cu, table, cp_group=OneRank()), want_legacy)
        # per-token positions really matter: a table read from 0..T-1 gives another result
        assert not torch.equal(fast(t, cu, table[: t.shape[0]], cp_group=OneRank()), want_exact)
        packed_rope._route_exact_mapping_to_one_rotation()  # idempotent
        assert rope_utils._apply_rotary_pos_emb_thd is fast
    finally:
        rope_utils._apply_rotary_pos_emb_thd = original

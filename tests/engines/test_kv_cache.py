"""The engine's slot KV cache: one tensor per K and V, batched slot compaction."""

from __future__ import annotations

import pytest
import torch

from palaestra.errors import EngineError
from palaestra.engines.local.kv_cache import SlotKVCache


@pytest.fixture(autouse=True)
def _inference_mode():
    with torch.inference_mode():  # as the engine uses it: its tensors are inference tensors
        yield


def _filled(slots: int = 6, length: int = 8) -> SlotKVCache:
    cache = SlotKVCache(3, 2, 4, dtype=torch.float32, device="cpu", max_length=64,
                        slots=slots, length=length, length_granularity=8)
    gen = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    return cache


def test_layer_views_are_contiguous_slices_of_one_tensor() -> None:
    cache = _filled()
    assert cache.k.shape == (3, 6, 2, 8, 4)
    assert cache.k[1].is_contiguous() and cache.k[1].data_ptr() == cache.k.data_ptr() + \
        cache.k[0].numel() * cache.k.element_size()


def test_move_many_equals_the_moves_one_at_a_time() -> None:
    a, b = _filled(), _filled()
    moves = [(5, 1), (4, 0), (3, 3)]  # a no-op move is skipped
    a.move_many(moves, 5)
    for src, dst in moves:
        b.move(src, dst, 5)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    assert torch.equal(a.k[:, 1, :, :5], _filled().k[:, 5, :, :5])
    assert torch.equal(a.k[:, 1, :, 5:], _filled().k[:, 1, :, 5:])  # beyond length: untouched


def test_extract_and_load_round_trip_every_layer() -> None:
    cache = _filled()
    k, v = cache.extract(2, 6)
    assert k.shape == (3, 2, 6, 4)
    cache.k[:, 4].zero_()
    cache.load(4, (k, v), 6)
    assert torch.equal(cache.k[:, 4, :, :6], cache.k[:, 2, :, :6])
    assert torch.equal(cache.v[:, 4, :, :6], cache.v[:, 2, :, :6])
    k[0, 0, 0, 0] = 123.0  # an extracted entry is a copy, not a view of the live cache
    assert cache.k[0, 2, 0, 0, 0] != 123.0


def test_growth_keeps_contents_and_release_frees() -> None:
    cache = _filled()
    before = cache.k.clone()
    cache.ensure(10, 20)
    assert cache.slots >= 10 and cache.length >= 20
    assert torch.equal(cache.k[:, :6, :, :8], before)
    assert cache.k[:, 6:].abs().sum() == 0 and cache.k[:, :, :, 8:].abs().sum() == 0
    cache.release()
    assert cache.k.numel() == 0 and cache.num_bytes() == 0
    with pytest.raises(EngineError, match="released"):
        cache.extract(0, 1)
    cache.ensure(2, 4)
    assert cache.k.shape[1] == 2

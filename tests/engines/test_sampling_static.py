"""`RowSampler.static_copy` / `load`: the static settings a CUDA graph samples with.

A graph captured for a padded batch samples with a static copy of a batch's sampler; after
`load` its first rows must sample exactly what the batch's own sampler does (same tokens, same
logprobs), whatever batch was loaded before, and padding rows must sample harmlessly.
"""

from __future__ import annotations

import pytest
import torch

from palaestra.engines.local.sampling import RowSampler

VOCAB = 97

SETTINGS = {  # (temperatures, top_ps, top_ks) of 5 rows
    "greedy": ([0.0] * 5, [1.0] * 5, [-1] * 5),
    "plain": ([1.0, 0.7, 1.3, 1.0, 0.5], [1.0] * 5, [-1] * 5),
    "filtered": ([1.0, 0.7, 1.3, 1.0, 0.5], [0.9, 1.0, 0.5, 1.0, 0.95], [-1, 5, 20, 1, -1]),
    "mixed": ([0.0, 0.7, 1.0, 0.0, 1.2], [1.0] * 5, [-1] * 5),
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_loaded_static_copy_samples_what_the_batch_sampler_does(name: str) -> None:
    gen = torch.Generator().manual_seed(3)
    temps, ps, ks = SETTINGS[name]
    batch = RowSampler(temps, ps, ks, VOCAB, "cpu")
    rows = 8
    static = batch.static_copy(rows)
    assert static.structure == batch.structure
    assert static.temps is not batch.temps and static.temps.shape == (rows,)
    # a previous, different batch of the same structure was loaded first
    other = RowSampler([t * 0.5 for t in temps], ps, ks, VOCAB, "cpu")
    static.load(other)
    static.load(batch)
    for _ in range(5):
        logits = torch.randn(rows, VOCAB, generator=gen) * 3
        uniforms = torch.rand(rows, generator=gen)
        want_t, want_lp = batch.sample(logits[:5].clone(), uniforms[:5])
        got_t, got_lp = static.sample(logits.clone(), uniforms)
        assert torch.equal(got_t[:5], want_t)
        assert torch.equal(got_lp[:5], want_lp)
        assert bool(((got_t >= 0) & (got_t < VOCAB)).all())  # padding rows too
        assert bool(torch.isfinite(got_lp).all())


def test_load_writes_only_the_batch_rows() -> None:
    temps, ps, ks = SETTINGS["filtered"]
    static = RowSampler(temps, ps, ks, VOCAB, "cpu").static_copy(8)
    static.load(RowSampler(temps, ps, ks, VOCAB, "cpu"))
    assert static.temps[5:].tolist() == [1.0] * 3  # padding rows keep T = 1
    assert static.ks is not None and static.ks[5:].tolist() == [VOCAB] * 3
    assert static.ps is not None and static.ps[5:].tolist() == [1.0] * 3
    assert static.ks[:5].tolist() == [VOCAB, 5, 20, 1, VOCAB]  # -1: the whole vocabulary

"""Sampling inside LocalEngine's captured decode graphs (skipped without a GPU).

The same requests on three engines (float32): sampling inside the graphs, sampling after the
replay (the eager `RowSampler` on the graph's logits), and no graphs at all. Greedy, plain,
top-k/top-p, seeded and unseeded rows share one batch; a logit bias sends the batch back to
sampling outside the graph. Tokens must be equal and logprobs within 1e-4.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_testing import prompts

from palaestra.engine import SamplingParams
from palaestra.engines.local.local import LocalEngine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _params(n: int, bias: bool) -> list[SamplingParams]:
    kinds: list[dict] = [{"temperature": 0}, {"temperature": 1.0},
                         {"temperature": 0.8, "seed": 5},
                         {"temperature": 0.7, "top_p": 0.9, "top_k": 40},
                         {"temperature": 1.2, "top_k": 1}]
    out = [SamplingParams(max_new_tokens=40, ignore_eos=True, **kinds[i % len(kinds)])
           for i in range(n)]
    if bias:
        out[1] = SamplingParams(max_new_tokens=40, ignore_eos=True, logit_bias={7: 2.0})
    return out


@pytest.mark.parametrize("bias", [False, True])
def test_sampling_in_the_graph_matches_sampling_after_it(model_dir: str, bias: bool) -> None:
    async def run() -> None:
        batch = prompts(21, lo=2, hi=90, seed=9)
        params = _params(len(batch), bias)
        engines = {name: LocalEngine(model_dir, device="cuda", dtype=torch.float32, seed=3,
                                     cuda_graphs=name != "eager")
                   for name in ("in_graph", "after_graph", "eager")}
        engines["after_graph"]._graphs.sample_in_graph = False
        try:
            out = {n: await asyncio.gather(*(e.generate(p, sp) for p, sp in zip(batch, params)))
                   for n, e in engines.items()}
            sampled_graphs = [key for key in engines["in_graph"]._graphs._graphs
                              if key[2] is not None]
            assert bool(sampled_graphs) != bias  # a logit bias keeps sampling outside
            for other in ("after_graph", "eager"):
                for got, want in zip(out["in_graph"], out[other]):
                    assert got.token_ids == want.token_ids, other
                    assert torch.allclose(torch.tensor(got.logprobs),
                                          torch.tensor(want.logprobs), atol=1e-4), other
        finally:
            for e in engines.values():
                await e.close()

    asyncio.run(run())

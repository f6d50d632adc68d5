"""LocalEngine on CUDA: same greedy tokens as transformers, with and without CUDA graphs, across
weight updates and KV-cache growth (skipped without a GPU)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from palaestra.engine import SamplingParams
from palaestra.engines.local.local import LocalEngine

from engine_testing import prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


async def _run(engine: LocalEngine, batch: list[list[int]], params=GREEDY):
    return await asyncio.gather(*(engine.generate(p, params) for p in batch))


def test_cuda_graphs_match_eager_and_hf(model_dir: str) -> None:
    asyncio.run(_graphs_match_eager_and_hf(model_dir))


def test_graphs_survive_weight_updates_and_cache_growth(model_dir: str,
                                                        other_weights_dir: str) -> None:
    asyncio.run(_graphs_survive_updates_and_growth(model_dir, other_weights_dir))


def test_bf16_sampling_runs(model_dir: str) -> None:
    asyncio.run(_bf16_sampling_runs(model_dir))


# plain functions run by asyncio.run: the GPU machine need not have pytest-asyncio
async def _graphs_match_eager_and_hf(model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    batch = prompts(20, lo=3, hi=50, seed=40)
    graphs = LocalEngine(model_dir, device="cuda", dtype=torch.float32, cuda_graphs=True)
    eager = LocalEngine(model_dir, device="cuda", dtype=torch.float32, cuda_graphs=False)
    try:
        with_graphs = await _run(graphs, batch)
        without = await _run(eager, batch)
        assert graphs._graphs.replays > 0
        assert [g.token_ids for g in with_graphs] == [g.token_ids for g in without]
        for a, b in zip(with_graphs, without):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
        for p, g in zip(batch[:4], with_graphs[:4]):
            with torch.inference_mode():
                ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=24,
                                  min_new_tokens=24, do_sample=False, pad_token_id=0)
            assert list(g.token_ids) == ref[0, len(p):].tolist()
    finally:
        await graphs.close()
        await eager.close()


async def _graphs_survive_updates_and_growth(model_dir: str, other_weights_dir: str) -> None:
    from safetensors.torch import load_file

    engine = LocalEngine(model_dir, device="cuda", dtype=torch.float32)
    reference = LocalEngine(other_weights_dir, device="cuda", dtype=torch.float32,
                            cuda_graphs=False)
    try:
        batch = prompts(6, seed=41)
        await _run(engine, batch)
        await engine.update_weights(load_file(f"{other_weights_dir}/model.safetensors"))
        long = SamplingParams(max_new_tokens=600, temperature=0, ignore_eos=True)  # cache grows
        got = await _run(engine, batch, long)
        want = await _run(reference, batch, long)
        assert [g.token_ids for g in got] == [g.token_ids for g in want]
        assert all(g.weight_version == 1 for g in got)
        assert engine.cache.length >= 600 and engine._graphs.captures >= 2
    finally:
        await engine.close()
        await reference.close()


async def _bf16_sampling_runs(model_dir: str) -> None:
    engine = LocalEngine(model_dir, device="cuda")  # bf16 by default on CUDA
    try:
        gens = await _run(engine, prompts(8, seed=42), SamplingParams(
            max_new_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=1))
        assert all(0 < len(g.token_ids) <= 16 and len(g.logprobs) == len(g.token_ids)
                   for g in gens)
        assert all(lp <= 0 for g in gens for lp in g.logprobs)
    finally:
        await engine.close()

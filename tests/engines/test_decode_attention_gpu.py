"""The grouped split-KV decode kernel on a GPU: Qwen3's head layout, CUDA graphs, the real engine.

Skipped without CUDA and Triton. The kernel is checked against the float32 reference at the
Qwen3-0.6B attention shape (16 query heads on 8 key/value heads, head_dim 128) with ragged
lengths, inside a CUDA graph captured once and replayed with new lengths, and through
`LocalEngine` (a random-init model of the Qwen3-0.6B layer shapes, two layers, float32, CUDA
graphs on): greedy tokens equal to the dense path's and logprobs within 1e-4, and seeded
sampling draws the same tokens.
"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch
from engine_testing import prompts

from palaestra.engine import SamplingParams
from palaestra.engines.local.local import LocalEngine

HAS_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")]

HEADS, KV_HEADS, DIM = 16, 8, 128


def _case(rows: int, key_len: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, HEADS + 2 * KV_HEADS, DIM, generator=gen)[:, :HEADS]
    k = torch.randn(rows + 3, KV_HEADS, key_len + 64, DIM, generator=gen)
    v = torch.randn(rows + 3, KV_HEADS, key_len + 64, DIM, generator=gen)
    lengths = torch.randint(1, key_len + 1, (rows,), generator=gen, dtype=torch.int32)
    lengths[0], lengths[-1] = 1, key_len
    for row, n in enumerate(lengths.tolist()):  # what no row may read
        k[row, :, n:] = float("nan")
        v[row, :, n:] = float("nan")
    return (q.to("cuda", dtype), k.to("cuda", dtype), v.to("cuda", dtype),
            lengths.to("cuda"))


@pytest.mark.parametrize("rows", [1, 7, 64, 256])
def test_qwen3_shape_matches_the_reference(rows: int) -> None:
    from palaestra.engines.local.decode_attention import (
        KernelConfig,
        decode_attention,
        dense_reference,
    )

    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        q, k, v, lengths = _case(rows, 1472, dtype, seed=rows)
        scale = DIM ** -0.5
        want = dense_reference(q, k.nan_to_num(0.0), v.nan_to_num(0.0), lengths, scale)
        for config in (KernelConfig(), KernelConfig(target_programs=1),
                       KernelConfig(min_chunk=64, target_programs=1 << 20)):
            got = decode_attention(q, k, v, lengths, scale, 1472, config=config)
            assert torch.isfinite(got).all(), config
            assert float((got.float() - want).abs().max()) < tol, (dtype, config)


def test_one_captured_graph_replays_with_new_lengths() -> None:
    from palaestra.engines.local.decode_attention import decode_attention, dense_reference

    q, k, v, lengths = _case(48, 960, torch.float32)
    k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)
    scale = DIM ** -0.5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode_attention(q, k, v, lengths, scale, 960)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, lengths, scale, 960)
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        lengths.copy_(torch.randint(1, 961, (48,), generator=gen, dtype=torch.int32).cuda())
        graph.replay()
        torch.cuda.synchronize()
        want = dense_reference(q, k, v, lengths, scale)
        assert float((out - want).abs().max()) < 1e-4


@pytest.fixture(scope="module")
def qwen3_shaped_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=4096, hidden_size=1024, intermediate_size=3072,
                         num_hidden_layers=2, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, head_dim=DIM, max_position_embeddings=4096,
                         rope_theta=1e6, tie_word_embeddings=True, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).eval()


@pytest.mark.parametrize("sampled", [False, True])
def test_engine_matches_the_dense_path(qwen3_shaped_model, sampled: bool) -> None:
    async def run() -> None:
        batch = prompts(40, lo=1, hi=700, seed=11, vocab=4000)
        params = [SamplingParams(max_new_tokens=48, ignore_eos=True,
                                 **({"temperature": 0.9, "top_p": 0.95, "top_k": 50,
                                     "seed": 100 + i} if sampled else {"temperature": 0}))
                  for i in range(len(batch))]
        engines = {mode: LocalEngine(hf_model=qwen3_shaped_model, device="cuda",
                                     dtype=torch.float32, max_running=64,
                                     decode_attention=mode) for mode in ("triton", "dense")}
        try:
            assert {m: e.decode_attention for m, e in engines.items()} == {
                "triton": "triton", "dense": "dense"}
            out = {m: await asyncio.gather(*(e.generate(p, sp) for p, sp in zip(batch, params)))
                   for m, e in engines.items()}
            assert engines["triton"]._graphs.replays > 0  # the kernel ran inside CUDA graphs
            for got, want in zip(out["triton"], out["dense"]):
                assert got.token_ids == want.token_ids
                assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs),
                                      atol=1e-4, rtol=0)
        finally:
            for e in engines.values():
                await e.close()

    asyncio.run(run())

"""The split-KV decode attention kernel against a dense reference, and the engine's choice of it.

The kernel runs on CUDA where Triton is (the GPU machine); on a CPU machine with Triton
installed it runs in Triton's interpreter (``TRITON_INTERPRET=1``); without Triton those tests
skip. The engine's refusal and fallback on CPU always run.
"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch
from engine_testing import prompts

from palaestra.errors import ConfigError
from palaestra.engine import SamplingParams
from palaestra.engines.local.local import LocalEngine

HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()


@pytest.fixture
def kernel_device(monkeypatch: pytest.MonkeyPatch) -> str:
    if not HAS_TRITON:
        pytest.skip("needs the triton package")
    if not CUDA:  # Triton's interpreter runs the same kernel on CPU tensors
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        from palaestra.engines.local import decode_attention

        decode_attention._kernel.cache_clear()  # jit the kernel under the interpreter
    return "cuda" if CUDA else "cpu"


@pytest.mark.parametrize(("rows", "heads", "kv_heads", "dim", "key_len"),
                         [(5, 4, 2, 16, 192), (3, 2, 2, 32, 128), (1, 8, 1, 16, 70),
                          (40, 4, 4, 16, 64)])
def test_kernel_matches_dense_reference(kernel_device: str, rows: int, heads: int,
                                        kv_heads: int, dim: int, key_len: int) -> None:
    from palaestra.engines.local.decode_attention import decode_attention, dense_reference

    gen = torch.Generator().manual_seed(rows * 7 + heads)
    # the engine's q is a view of the fused q/k projections: not contiguous across rows
    q = torch.randn(rows, heads + kv_heads, dim, generator=gen)[:, :heads].to(kernel_device)
    cap = key_len + 9
    k = torch.randn(rows + 2, kv_heads, cap, dim, generator=gen).to(kernel_device)
    v = torch.randn(rows + 2, kv_heads, cap, dim, generator=gen).to(kernel_device)
    lengths = torch.randint(1, key_len + 1, (rows,), generator=gen, dtype=torch.int32)
    lengths[0] = 1  # a row with one key, and one using the whole bucket
    lengths[-1] = key_len
    lengths = lengths.to(kernel_device)
    # keys past a row's length are garbage in a real cache: make them huge to catch any read
    for row, n in enumerate(lengths.tolist()):
        k[row, :, n:] = 1e4
        v[row, :, n:] = 1e4
    got = decode_attention(q, k, v, lengths, dim ** -0.5, key_len)
    want = dense_reference(q, k, v, lengths, dim ** -0.5)
    assert got.shape == (rows, heads, dim)
    assert float((got.float() - want).abs().max()) < 1e-4


def test_engine_refuses_triton_where_it_cannot_run(tmp_path) -> None:
    from palaestra.tiny_model import build_model

    if CUDA and HAS_TRITON:
        pytest.skip("triton can run here")
    path = build_model(tmp_path / "tiny", "tiny")
    with pytest.raises(ConfigError, match="decode_attention = 'triton' cannot run here"):
        LocalEngine(path, device="cpu", decode_attention="triton")
    engine = LocalEngine(path, device="cpu", decode_attention="auto")  # dense here, no error
    assert engine.decode_attention == "dense"
    asyncio.run(engine.close())
    with pytest.raises(ConfigError, match="use auto, triton or dense"):
        LocalEngine(path, device="cpu", decode_attention="flash")


@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA and HAS_TRITON), reason="needs CUDA and triton")
def test_engine_with_the_kernel_decodes_what_the_dense_path_does(model_dir: str) -> None:
    async def run() -> None:
        batch = prompts(24, lo=3, hi=120, seed=5)
        params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
        fast = LocalEngine(model_dir, device="cuda", dtype=torch.float32,
                           decode_attention="triton")
        dense = LocalEngine(model_dir, device="cuda", dtype=torch.float32,
                            decode_attention="dense")
        try:
            assert fast.decode_attention == "triton" and dense.decode_attention == "dense"
            got = await asyncio.gather(*(fast.generate(p, params) for p in batch))
            want = await asyncio.gather(*(dense.generate(p, params) for p in batch))
            assert [g.token_ids for g in got] == [g.token_ids for g in want]
            for a, b in zip(got, want):
                assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                      atol=1e-4)
        finally:
            await fast.close()
            await dense.close()

    asyncio.run(run())

"""LoRA in the embedded engine on CUDA (fp32, CUDA graphs on): both modes give the merged
model's greedy tokens; two adapters side by side in one batch (skips without CUDA)."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("peft")

from palaestra.engines.local.local import LocalEngine  # noqa: E402

from test_engine_lora import GREEDY, PROMPTS, assert_same, make_adapter  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("mode", ["merged", "lowrank"])
async def test_adapters_on_cuda_match_the_merged_models(model_dir: str, tmp_path, mode: str
                                                        ) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    paths = {}
    for seed, name in ((5, "a"), (6, "b")):
        (tmp_path / name).mkdir()
        paths[name] = make_adapter(model_dir, tmp_path / name, seed,
                                   ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj"])
    kw = {"device": "cuda", "dtype": torch.float32, "prefix_cache_tokens": 0}
    engine = LocalEngine(model_dir, lora_mode=mode, **kw)
    refs = {n: LocalEngine(str(merged), **kw) for n, (_, merged) in paths.items()}
    try:
        await engine.load_lora_adapter("a", str(paths["a"][0]), default=True)
        await engine.load_lora_adapter("b", str(paths["b"][0]))
        got = await asyncio.gather(*(engine.generate(p, GREEDY, lora=lora)
                                     for p in PROMPTS for lora in (None, "b")))
        for i, p in enumerate(PROMPTS):
            assert_same(got[2 * i], await refs["a"].generate(p, GREEDY))
            assert_same(got[2 * i + 1], await refs["b"].generate(p, GREEDY))
    finally:
        for e in (engine, *refs.values()):
            await e.close()

"""Routing replay on a GPU in bf16: the embedded engine (bf16, CUDA) and the torch backend (bf16
autocast over fp32 weights) route some tokens differently; replay must lower the rollout-vs-train
mismatch (``actor/rollout_kl`` and the mean |logprob| gap). Numbers are printed (``-s``)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CFG = {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512,
       "moe_intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 8,
       "num_key_value_heads": 4, "head_dim": 32, "num_experts": 16, "num_experts_per_tok": 4,
       "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
       "max_position_embeddings": 2048, "initializer_range": 0.05, "router_aux_loss_coef": 0.0,
       "eos_token_id": 1, "pad_token_id": 0}


def _samples(path: Path) -> list[Any]:
    from palaestra.engine import SamplingParams
    from palaestra.engines.local.local import LocalEngine
    from palaestra.types import Sample

    async def go() -> list[Any]:
        engine = LocalEngine(path, device="cuda", dtype="bfloat16")
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(2, CFG["vocab_size"], (32 + 8 * i,), generator=g).tolist()
                   for i in range(16)]
        try:
            gens = await asyncio.gather(*(engine.generate(p, SamplingParams(
                max_new_tokens=128, temperature=1.0, seed=i, ignore_eos=True))
                for i, p in enumerate(prompts)))
        finally:
            await engine.close()
        out = []
        for i, (p, gen) in enumerate(zip(prompts, gens)):
            ids = p + list(gen.token_ids)
            routes = torch.full((len(ids), CFG["num_hidden_layers"], CFG["num_experts_per_tok"]),
                                -1, dtype=torch.int16)
            got = gen.meta["routed_experts"]
            routes[: got.shape[0]] = got
            n = len(gen.token_ids)
            out.append(Sample(tuple(ids), (0,) * len(p) + (1,) * n, (0.0,) * len(p)
                              + tuple(gen.logprobs), (-1,) * len(p) + (0,) * n, len(p),
                              group_id="g", advantage=1.0 if i % 2 else -1.0,
                              routed_experts=routes))
        return out

    return asyncio.run(go())


def test_replay_lowers_the_bf16_mismatch(tmp_path: Path) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from palaestra.trainers.algorithms.config import LossConfig
    from palaestra.trainers.batching import TrainBatch
    from palaestra.trainers.torch_backend.backend import TorchBackend
    from palaestra.trainers.torch_backend.config import TorchBackendConfig

    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**CFG)).save_pretrained(tmp_path)
    batch = TrainBatch.from_samples(_samples(tmp_path))
    result = {}
    for mode in ("off", "rollout"):
        backend = TorchBackend(tmp_path, TorchBackendConfig(
            device="cuda", dtype="bfloat16", lr=1e-5, routing_replay=mode))
        logps = backend.forward_logprobs(batch)
        gap = torch.cat([(lp - r)[m > 0].abs()
                         for lp, r, m in zip(logps, batch.rollout_logprobs, batch.loss_mask)])
        kl = backend.train_step(batch, LossConfig(preset="grpo"))["actor/rollout_kl"]
        result[mode] = {"mean_abs_gap": float(gap.mean()), "max_abs_gap": float(gap.max()),
                        "rollout_kl": kl}
        del backend
        torch.cuda.empty_cache()
    print("routing replay bf16 GPU:", result)
    assert result["rollout"]["mean_abs_gap"] < result["off"]["mean_abs_gap"]
    assert result["rollout"]["rollout_kl"] < result["off"]["rollout_kl"]

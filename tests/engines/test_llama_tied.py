"""LocalEngine on a SmolLM2-shaped Llama (tied embeddings, rope_theta 1e5, 3:1 grouped-query
attention, head_dim 16): greedy tokens equal transformers' ``generate``, logprobs equal one full
forward pass within 1e-4 (float32)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from palaestra.engine import SamplingParams
from palaestra.engines.local.local import LocalEngine
from palaestra.engines.local.sampling import token_logprobs

from engine_testing import prompts

VOCAB = 512


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(  # SmolLM2-135M's settings at 1/4 of its width, 2 of its 30 layers
        vocab_size=VOCAB, hidden_size=144, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=9, num_key_value_heads=3, head_dim=16, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=256, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the 0.02 init: sharper, less tied distributions
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    out = tmp_path_factory.mktemp("llama-tied") / "model"
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def hf_llama(llama_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


@pytest.fixture
async def llama_engine(llama_dir: Path):
    engine = LocalEngine(llama_dir, device="cpu", dtype=torch.float32, max_running=8)
    yield engine
    await engine.close()


def test_the_engine_ties_the_head_to_the_embedding(llama_dir: Path) -> None:
    engine = LocalEngine(llama_dir, device="cpu", dtype=torch.float32)
    try:
        decoder = engine.decoder
        assert decoder.config.tie_word_embeddings and decoder.config.model_type == "llama"
        assert decoder.lm_head is decoder.embed
        assert not decoder.config.qk_norm
    finally:
        asyncio.run(engine.close())


async def test_greedy_matches_hf_generate(llama_engine: LocalEngine, hf_llama) -> None:
    greedy = SamplingParams(max_new_tokens=24, temperature=0)
    for prompt in prompts(4, lo=5, hi=60, seed=1, vocab=VOCAB):
        gen = await llama_engine.generate(prompt, greedy)
        with torch.inference_mode():
            ref = hf_llama.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                    pad_token_id=2)[0, len(prompt):].tolist()
        assert list(gen.token_ids) == ref


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_logprobs_match_a_full_forward_pass(llama_engine: LocalEngine, hf_llama,
                                                  temperature: float) -> None:
    params = SamplingParams(max_new_tokens=32, temperature=temperature, seed=3, ignore_eos=True)
    batch = prompts(4, lo=5, hi=120, seed=2, vocab=VOCAB)
    results = await asyncio.gather(*(llama_engine.generate(p, params) for p in batch))
    for prompt, gen in zip(batch, results):
        output = list(gen.token_ids)
        with torch.inference_mode():
            logits = hf_llama(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
        ref = token_logprobs(logits, torch.tensor(output), temperature)
        got = torch.tensor(gen.logprobs)
        assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()

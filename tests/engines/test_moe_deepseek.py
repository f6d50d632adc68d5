"""The embedded engine on a tiny random DeepSeek-V3 (MLA, sigmoid group routing with expert bias,
shared experts, a dense first layer) against transformers' ``DeepseekV3ForCausalLM`` (fp32)."""

from __future__ import annotations

import asyncio
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from palaestra.engine import SamplingParams
from palaestra.engines.local.deepseek import MLADecoder
from palaestra.engines.local.local import LocalEngine
from palaestra.engines.local.loading import decoder_from_hf_model, load_decoder

TINY = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
        "v_head_dim": 12, "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4,
        "topk_group": 2, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1, "norm_topk_prob": True, "max_position_embeddings": 256,
        "eos_token_id": 1, "pad_token_id": 0}


def _hf(seed: int = 0, **over):
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_config(DeepseekV3Config(**{**TINY, **over}),
                                             attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.1)
    return model


def _reference(model, ids: list[int]):
    """HF logits and each sparse layer's chosen experts (from its router module)."""
    chosen: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda _m, _i, out, i=i: chosen.__setitem__(i, out[2]))
        for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
    finally:
        for h in hooks:
            h.remove()
    return logits, chosen


@pytest.mark.parametrize("interleave", [True, False])
def test_mla_forward_matches_hf(interleave: bool) -> None:
    model = _hf(rope_interleave=interleave)
    dec = decoder_from_hf_model(model)
    assert isinstance(dec, MLADecoder)
    ids = list(range(2, 60))
    logits, chosen = _reference(model, ids)
    torch.testing.assert_close(dec.prefill_full(torch.tensor(ids)), logits, atol=1e-4, rtol=1e-4)
    assert dec.last_routes[0] is None
    for i, ref in chosen.items():
        assert torch.equal(dec.last_routes[i].sort(-1).values, ref.sort(-1).values)


def test_q_proj_without_lora_and_checkpoint_layout(tmp_path) -> None:
    model = _hf(seed=1, q_lora_rank=None)
    model.save_pretrained(tmp_path)
    dec = load_decoder(tmp_path, "cpu", torch.float32)
    ids = list(range(5, 40))
    torch.testing.assert_close(dec.prefill_full(torch.tensor(ids)), _reference(model, ids)[0],
                               atol=1e-4, rtol=1e-4)


async def test_engine_greedy_and_routes_match_hf() -> None:
    model = _hf(seed=2)
    engine = LocalEngine(hf_model=model, device="cpu", max_running=4)
    greedy = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    try:
        prompts = [list(range(3, 3 + n)) for n in (5, 17, 9)]
        shared = list(range(20, 40))
        prompts += [shared + [4], shared + [5, 6]]
        gens = await asyncio.gather(*(engine.generate(p, greedy) for p in prompts))
        later = await engine.generate(shared + [7], greedy)
        assert later.cached_tokens > 0
        for p, gen in [*zip(prompts, gens), (shared + [7], later)]:
            with torch.no_grad():
                ref = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
            assert list(gen.token_ids) == ref[0, len(p):].tolist()
            full = p + list(gen.token_ids)
            logits, chosen = _reference(model, full)
            lp = torch.log_softmax(logits[len(p) - 1 : -1], -1)
            lp = lp.gather(1, torch.tensor(gen.token_ids)[:, None])[:, 0]
            assert max(abs(a - b) for a, b in zip(gen.logprobs, lp.tolist())) < 1e-4
            routes = gen.meta["routed_experts"]
            assert routes.shape == (len(full) - 1, 3, 3) and (routes[:, 0] == -1).all()
            for i, ref_ids in chosen.items():
                assert torch.equal(routes[:, i].long().sort(-1).values,
                                   ref_ids[:-1].sort(-1).values)
    finally:
        await engine.close()


def test_moving_and_sizing_cover_every_mla_weight() -> None:
    """`Decoder.to_device` / `num_bytes` walk the layer's own slots (MLA layers have other ones)
    and re-index the weights, reshaped MLA views included."""
    from palaestra.engines.local.deepseek import _SLOTS

    dec = decoder_from_hf_model(_hf(seed=2))
    tensors = {id(t): t for t in (dec.embed, dec.lm_head, dec.final_norm)}
    for layer in dec.layers:
        tensors.update({id(t): t for t in (getattr(layer, n) for n in _SLOTS) if t is not None})
    assert dec.num_bytes() == sum(t.numel() * t.element_size() for t in tensors.values())
    name = next(n for n in dec.weight_names if n in dec._reshape)  # a view MLA reshapes
    dec.to_device("meta")
    assert all(getattr(layer, n) is None or getattr(layer, n).device.type == "meta"
               for layer in dec.layers for n in _SLOTS)
    assert dec.weight(name).device.type == "meta" and dec.cos.device.type == "meta"

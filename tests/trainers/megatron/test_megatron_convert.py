"""HF <-> Megatron conversion on tiny random HF models (CPU, no megatron needed)."""

from __future__ import annotations

import pytest
import torch

from palaestra.errors import ConfigError
from palaestra.trainers.megatron import convert_moe
from palaestra.trainers.megatron.arch import arch_from_hf_config
from palaestra.trainers.megatron.convert import (
    fuse_qkv,
    hf_to_mcore,
    iter_mcore_to_hf,
    mcore_to_hf,
    split_qkv,
)
from palaestra.trainers.megatron.sharding import shard_state_dict, unshard_state_dicts

DENSE = [("qwen3", False), ("qwen3", True), ("qwen2", False), ("qwen2", True), ("llama", False)]


def _hf_checkpoint_sd(model, arch):
    """The HF state dict as a checkpoint holds it (tied head dropped, experts unfused)."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if arch.tie_embeddings:
        sd.pop("lm_head.weight", None)
    return convert_moe.unfuse_hf_experts(sd, arch) if arch.moe else sd


def _assert_same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("family,tie", DENSE)
def test_dense_round_trip_is_bit_exact(hf_model_factory, family, tie):
    model = hf_model_factory(family, tie=tie)
    arch = arch_from_hf_config(model.config)
    hf = _hf_checkpoint_sd(model, arch)
    mc = hf_to_mcore(hf, arch)
    assert ("output_layer.weight" in mc) is (not tie)
    _assert_same(mcore_to_hf(mc, arch), hf)
    _assert_same(dict(iter_mcore_to_hf(mc.items(), arch)), hf)


def test_round_trip_in_bfloat16_with_padded_vocab_and_fused_norm_names(hf_model_factory):
    model = hf_model_factory("qwen3").to(torch.bfloat16)
    arch = arch_from_hf_config(model.config)
    hf = _hf_checkpoint_sd(model, arch)
    mc = hf_to_mcore(hf, arch, padded_vocab=128, fused_norms=True)
    emb = mc["embedding.word_embeddings.weight"]
    assert emb.shape[0] == 128 and torch.count_nonzero(emb[arch.vocab_size :]) == 0
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in mc
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in mc
    assert "decoder.layers.0.input_layernorm.weight" not in mc
    _assert_same(mcore_to_hf(mc, arch), hf)


@pytest.mark.parametrize("family,tie", DENSE)
def test_megatron_layout_computes_the_hf_function(hf_model_factory, mcore_reference, family, tie):
    model = hf_model_factory(family, tie=tie)
    arch = arch_from_hf_config(model.config)
    mc = hf_to_mcore(_hf_checkpoint_sd(model, arch), arch)
    ids = torch.randint(0, arch.vocab_size, (12,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids[None]).logits[0]
        got = mcore_reference([mc], arch, ids)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (got - expected).abs().max()


def test_qkv_layout_is_grouped_by_query_group():
    nh, ng, d, h = 6, 2, 3, 5
    q = torch.arange(nh * d * h, dtype=torch.float32).reshape(nh * d, h)
    k = -torch.arange(ng * d * h, dtype=torch.float32).reshape(ng * d, h) - 1
    v = k - 1000
    fused = fuse_qkv(q, k, v, ng)
    hpg = nh // ng
    expected = []
    for g in range(ng):
        expected += [q[(g * hpg + i) * d : (g * hpg + i + 1) * d] for i in range(hpg)]
        expected += [k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]
    assert torch.equal(fused, torch.cat(expected))
    back = split_qkv(fused, ng, hpg, d)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))
    bias = fuse_qkv(q[:, 0], k[:, 0], v[:, 0], ng)  # 1-D biases use the same layout
    assert torch.equal(bias, fused[:, 0])


@pytest.mark.parametrize("tp", [2])
@pytest.mark.parametrize("family,tie", [("qwen3", True), ("qwen2", False), ("llama", False)])
def test_tp_sharded_round_trip_and_function(hf_model_factory, mcore_reference, family, tie, tp):
    model = hf_model_factory(family, tie=tie)
    arch = arch_from_hf_config(model.config)
    hf = _hf_checkpoint_sd(model, arch)
    mc = hf_to_mcore(hf, arch)
    shards = shard_state_dict(mc, tp)
    qkv = shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape[0] == mc["decoder.layers.0.self_attention.linear_qkv.weight"].shape[0] // tp
    _assert_same(unshard_state_dicts(shards), mc)
    _assert_same(mcore_to_hf(unshard_state_dicts(shards), arch), hf)
    ids = torch.randint(0, arch.vocab_size, (10,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids[None]).logits[0]
        got = mcore_reference(shards, arch, ids)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_gated_fc1_shards_gate_and_up_separately():
    ffn, h, tp = 8, 3, 2
    gate = torch.arange(ffn * h, dtype=torch.float32).reshape(ffn, h)
    up = -gate - 1
    full = {"decoder.layers.0.mlp.linear_fc1.weight": torch.cat([gate, up])}
    shards = shard_state_dict(full, tp)
    for r, s in enumerate(shards):
        half = ffn // tp
        want = torch.cat([gate[r * half : (r + 1) * half], up[r * half : (r + 1) * half]])
        assert torch.equal(s["decoder.layers.0.mlp.linear_fc1.weight"], want)


def test_missing_and_extra_hf_tensors_are_reported(hf_model_factory):
    model = hf_model_factory("qwen3")
    arch = arch_from_hf_config(model.config)
    hf = _hf_checkpoint_sd(model, arch)
    missing = dict(hf)
    missing.pop("model.layers.1.self_attn.k_norm.weight")
    with pytest.raises(ConfigError, match="k_norm"):
        hf_to_mcore(missing, arch)
    extra = dict(hf, **{"model.layers.0.self_attn.o_proj.bias": torch.zeros(arch.hidden_size)})
    with pytest.raises(ConfigError, match="does not use"):
        hf_to_mcore(extra, arch)
    with pytest.raises(ConfigError, match="unknown Megatron parameter"):
        mcore_to_hf({"decoder.layers.0.mystery.weight": torch.zeros(1)}, arch)


def test_critic_value_head_maps_to_hf_score_and_drops_the_lm_head(hf_model_factory):
    import dataclasses

    from palaestra.trainers.megatron.convert import VALUE_HEAD

    model = hf_model_factory("qwen3", tie=False)
    arch = dataclasses.replace(arch_from_hf_config(model.config), value_head=True)
    causal = dict(model.state_dict())
    # from a causal LM: the LM head is dropped and the value head keeps its own initialisation
    mc = hf_to_mcore(causal, arch)
    assert not any(k.startswith("output_layer.") for k in mc)
    # from a token-classification checkpoint: score <-> output_layer, both ways, bit-exact
    critic = {k: v for k, v in causal.items() if k != "lm_head.weight"}
    critic.update({"score.weight": torch.randn(1, arch.hidden_size), "score.bias": torch.randn(1)})
    mc = hf_to_mcore(critic, arch)
    assert set(VALUE_HEAD) <= set(mc)
    back = mcore_to_hf(mc, arch)
    assert sorted(back) == sorted(critic)
    assert all(torch.equal(back[k], critic[k]) for k in critic)

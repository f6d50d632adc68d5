"""DeepSeek-V3 layout: config reading, conversion both ways, and a reference forward pass (CPU).

The reference decoder (conftest) computes multi-latent attention and the sigmoid, bias-steered,
group-limited router the way megatron-core does, on the converted Megatron tensors; matching the
HF model's logits shows the conversion keeps the function for both rotary layouts.
"""

from __future__ import annotations

import pytest
import torch

from palaestra.errors import ConfigError
from palaestra.trainers.megatron import convert_moe
from palaestra.trainers.megatron.arch import arch_from_hf_config
from palaestra.trainers.megatron.convert import hf_to_mcore, iter_mcore_to_hf, mcore_to_hf
from palaestra.trainers.megatron.convert_mla import deinterleave_rows
from palaestra.trainers.megatron.flops import param_count, train_flops_per_token
from palaestra.trainers.megatron.weight_sync import bucketize, module_copier


def _ckpt(model, arch):
    return convert_moe.unfuse_hf_experts(model.state_dict(), arch)


def test_arch_reads_the_deepseek_v3_layout(hf_model_factory):
    model = hf_model_factory("deepseek_v3")
    arch = arch_from_hf_config(model.config)
    assert arch.mla is not None and arch.mla.qk_head_dim == 16 and arch.mla.v_head_dim == 12
    assert arch.mla.rope_interleave and arch.yarn is None
    moe = arch.moe
    assert moe is not None and moe.layers == (False, True, True)  # first_k_dense_replace=1
    assert (moe.score_function, moe.expert_bias, moe.num_groups, moe.group_topk) == (
        "sigmoid", True, 4, 2)
    assert moe.scaling_factor == 2.5 and moe.shared_expert_ffn == 16
    assert arch.attention_dims == (16, 12)


@pytest.mark.parametrize("q_lora_rank", [24, None])
@pytest.mark.parametrize("interleave", [True, False])
def test_round_trip_is_bit_exact_and_keeps_the_function(hf_model_factory, mcore_reference,
                                                        q_lora_rank, interleave):
    model = hf_model_factory("deepseek_v3", q_lora_rank=q_lora_rank, rope_interleave=interleave)
    arch = arch_from_hf_config(model.config)
    mc = hf_to_mcore(model.state_dict(), arch)  # transformers-5 fused experts in, per expert out
    ckpt = _ckpt(model, arch)
    back = mcore_to_hf(mc, arch)
    assert sorted(back) == sorted(ckpt)
    assert all(torch.equal(back[k], ckpt[k]) for k in ckpt)
    assert ("decoder.layers.0.self_attention.linear_q_proj.weight" in mc) == (q_lora_rank is None)
    ids = torch.tensor([3, 17, 5, 88, 41, 2, 60, 9, 33, 71, 12])
    with torch.no_grad():
        expected = model(ids[None]).logits[0]
        got = mcore_reference([mc], arch, ids)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_non_interleaved_rotary_rows_are_interleaved_for_megatron(hf_model_factory):
    model = hf_model_factory("deepseek_v3", rope_interleave=False)
    arch = arch_from_hf_config(model.config)
    mc = hf_to_mcore(model.state_dict(), arch)
    hf_kv = model.state_dict()["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    mc_kv = mc["decoder.layers.0.self_attention.linear_kv_down_proj.weight"]
    rope = arch.mla.qk_rope_head_dim
    assert torch.equal(mc_kv[:-rope], hf_kv[:-rope])  # the latent rows are untouched
    assert not torch.equal(mc_kv[-rope:], hf_kv[-rope:])
    assert torch.equal(deinterleave_rows(mc_kv[-rope:]), hf_kv[-rope:])


def test_multi_token_prediction_layers_are_dropped(hf_model_factory):
    model = hf_model_factory("deepseek_v3")
    arch = arch_from_hf_config(model.config)
    sd = dict(model.state_dict())
    sd["model.layers.3.eh_proj.weight"] = torch.zeros(4, 4)  # as DeepSeek-V3 checkpoints carry
    mc = hf_to_mcore(sd, arch)
    assert not any(".layers.3." in k for k in mc)


def test_module_copier_fills_a_live_deepseek_model_including_the_routing_bias(hf_model_factory):
    source = hf_model_factory("deepseek_v3", seed=1)
    target = hf_model_factory("deepseek_v3", seed=2)
    arch = arch_from_hf_config(source.config)
    copy = module_copier(target)
    for bucket in bucketize(iter_mcore_to_hf(hf_to_mcore(source.state_dict(), arch).items(),
                                             arch), bucket_bytes=8192):
        copy(bucket)
    for name, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name
    ids = torch.arange(12)[None]
    with torch.no_grad():
        assert torch.equal(target(ids).logits, source(ids).logits)


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_param_count_and_flops(hf_model_factory, q_lora_rank):
    model = hf_model_factory("deepseek_v3", q_lora_rank=q_lora_rank)
    arch = arch_from_hf_config(model.config)
    assert param_count(arch).total == model.num_parameters()
    m = arch.mla
    attention = 3 * 2 * arch.num_layers * arch.num_heads * (m.qk_head_dim + m.v_head_dim) * 4.5
    assert train_flops_per_token(arch, 8) == pytest.approx(6 * param_count(arch).matmul + attention)


def _deepseek_config(**over):
    from tests.trainers.megatron.conftest import DEEPSEEK_TINY

    return {"model_type": "deepseek_v3", **DEEPSEEK_TINY, **over}


def test_yarn_scaling_is_read_from_either_config_layout():
    old = _deepseek_config(rope_scaling={"type": "yarn", "factor": 40, "mscale": 1.0,
                                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                                         "original_max_position_embeddings": 4096})
    new = _deepseek_config(rope_parameters={"rope_type": "yarn", "rope_theta": 5e4, "factor": 40.0,
                                            "mscale": 1.0, "mscale_all_dim": 1.0,
                                            "original_max_position_embeddings": 4096})
    for cfg in (old, new):
        y = arch_from_hf_config(cfg).yarn
        assert y is not None and (y.factor, y.original_max_position_embeddings) == (40.0, 4096)
        assert (y.mscale, y.mscale_all_dim, y.beta_fast, y.beta_slow) == (1.0, 1.0, 32.0, 1.0)
    assert arch_from_hf_config(new).rope_theta == 5e4


@pytest.mark.parametrize("change,match", [
    ({"topk_group": 1}, "must be 2"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"quantization_config": {"quant_method": "fp8"}}, "dequantize"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "not supported"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "original_max_position_embeddings"),
])
def test_unsupported_deepseek_configs_are_refused(change, match):
    with pytest.raises(ConfigError, match=match):
        arch_from_hf_config(_deepseek_config(**change))

"""Qwen3-MoE conversion: router and experts both ways, EP and expert-TP sharding (CPU)."""

from __future__ import annotations

import pytest
import torch

from palaestra.trainers.megatron import convert_moe
from palaestra.trainers.megatron.arch import arch_from_hf_config
from palaestra.trainers.megatron.convert import hf_to_mcore, mcore_to_hf
from palaestra.trainers.megatron.sharding import (
    ep_shard_state_dict,
    ep_unshard_state_dicts,
    shard_state_dict,
    unshard_state_dicts,
)


@pytest.fixture
def moe(hf_model_factory):
    model = hf_model_factory("qwen3_moe")
    arch = arch_from_hf_config(model.config)
    fused = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return model, arch, fused


def _same(a, b):
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_arch_reads_moe_layout(moe):
    _, arch, _ = moe
    assert arch.moe is not None and arch.moe.num_experts == 4 and arch.moe.top_k == 2
    assert arch.moe.layers == (True, False)  # mlp_only_layers=[1]


def test_fused_and_checkpoint_hf_layouts_round_trip(moe):
    _, arch, fused = moe
    ckpt = convert_moe.unfuse_hf_experts(fused, arch)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in ckpt
    assert "model.layers.0.mlp.experts.gate_up_proj" not in ckpt
    _same(convert_moe.fuse_hf_experts(ckpt, arch), fused)


@pytest.mark.parametrize("grouped", [False, True])
def test_moe_round_trip_is_bit_exact(moe, grouped):
    _, arch, fused = moe
    ckpt = convert_moe.unfuse_hf_experts(fused, arch)
    mc = hf_to_mcore(fused, arch, grouped_experts=grouped)  # fused input is accepted too
    name = ("decoder.layers.0.mlp.experts.linear_fc1.weight2" if grouped
            else "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight")
    assert torch.equal(mc[name], fused["model.layers.0.mlp.experts.gate_up_proj"][2])
    assert torch.equal(mc["decoder.layers.0.mlp.router.weight"],
                       fused["model.layers.0.mlp.gate.weight"])
    assert "decoder.layers.1.mlp.linear_fc1.weight" in mc  # the dense layer stays dense
    _same(mcore_to_hf(mc, arch), ckpt)


def test_moe_megatron_layout_computes_the_hf_function(moe, mcore_reference):
    model, arch, fused = moe
    mc = hf_to_mcore(fused, arch)
    ids = torch.randint(0, arch.vocab_size, (16,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids[None]).logits[0]
        got = mcore_reference([mc], arch, ids)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (got - expected).abs().max()


def test_expert_parallel_shards_round_trip(moe):
    _, arch, fused = moe
    mc = hf_to_mcore(fused, arch)
    shards = ep_shard_state_dict(mc, 2, arch.moe.num_experts)
    local = [k for k in shards[1] if ".local_experts." in k]
    assert {k.split(".local_experts.")[1].split(".")[0] for k in local} == {"0", "1"}
    assert torch.equal(shards[1]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"],
                       mc["decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight"])
    _same(ep_unshard_state_dicts(shards), mc)


@pytest.mark.parametrize("expert_size", [1, 2])
def test_expert_tensor_parallel_round_trip(moe, expert_size):
    _, arch, fused = moe
    mc = hf_to_mcore(fused, arch)
    shards = shard_state_dict(mc, 2, expert_size=expert_size)
    name = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    assert shards[0][name].shape[0] == mc[name].shape[0] // expert_size
    assert torch.equal(shards[0]["decoder.layers.0.mlp.router.weight"],
                       mc["decoder.layers.0.mlp.router.weight"])
    _same(unshard_state_dicts(shards, expert_size=expert_size), mc)

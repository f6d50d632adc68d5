"""Weight-sync consumers and buckets on CPU: HF-named tensors copied into live HF modules."""

from __future__ import annotations

import pytest
import torch

from palaestra.errors import EngineError
from palaestra.trainers.megatron import convert_moe
from palaestra.trainers.megatron.arch import arch_from_hf_config
from palaestra.trainers.megatron.convert import hf_to_mcore, iter_mcore_to_hf
from palaestra.trainers.megatron.weight_sync import bucketize, module_copier


def test_bucketize_bounds_bytes_and_keeps_order():
    named = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([3, 5, 2, 10, 1])]
    buckets = list(bucketize(named, bucket_bytes=32))  # 8 floats per bucket
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]


@pytest.mark.parametrize("family,tie", [("qwen3", True), ("qwen3_moe", False)])
def test_module_copier_moves_every_weight_into_a_live_hf_model(hf_model_factory, family, tie):
    source = hf_model_factory(family, tie=tie, seed=1)
    target = hf_model_factory(family, tie=tie, seed=2)
    arch = arch_from_hf_config(source.config)
    mc = hf_to_mcore(source.state_dict(), arch)  # what the Megatron model would hold
    copy = module_copier(target)
    for bucket in bucketize(iter_mcore_to_hf(mc.items(), arch), bucket_bytes=4096):
        copy(bucket)
    for name, value in source.state_dict().items():  # fused experts and tied head included
        assert torch.equal(target.state_dict()[name], value), name
    ids = torch.arange(10)[None]
    with torch.no_grad():
        assert torch.equal(target(ids).logits, source(ids).logits)


def test_module_copier_refuses_unknown_names_and_shapes(hf_model_factory):
    target = hf_model_factory("qwen3")
    copy = module_copier(target)
    with pytest.raises(EngineError, match="no parameter"):
        copy([("model.layers.9.mlp.gate_proj.weight", torch.zeros(1))])
    with pytest.raises(EngineError, match="shape"):
        copy([("model.norm.weight", torch.zeros(3))])


def test_checkpoint_layout_names_for_moe(hf_model_factory):
    model = hf_model_factory("qwen3_moe")
    arch = arch_from_hf_config(model.config)
    names = {n for n, _ in iter_mcore_to_hf(hf_to_mcore(model.state_dict(), arch).items(), arch)}
    ckpt = set(convert_moe.unfuse_hf_experts(model.state_dict(), arch))
    assert names == ckpt and "model.layers.0.mlp.experts.3.up_proj.weight" in names

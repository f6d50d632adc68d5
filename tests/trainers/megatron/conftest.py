"""Fixtures for the Megatron backend tests: tiny random HF models and a reference forward pass.

`reference_logits` runs a decoder written directly against Megatron's tensor layout (fused QKV by
query group, fc1 = [gate; up], router + experts) with plain torch, optionally over tensor-parallel
shards (partial sums of row-parallel outputs, as Megatron's all-reduce does). Comparing it with
the HF model proves the conversion keeps the function, not only that it is invertible.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

TINY = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6}


def make_hf_model(family: str, *, tie: bool = False, seed: int = 0, **over: Any) -> Any:
    """A tiny random HF causal LM of ``family`` (float32, eval mode), built from config."""
    import transformers

    cfg_cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
               "llama": transformers.LlamaConfig, "qwen3_moe": transformers.Qwen3MoeConfig}[family]
    kwargs = dict(TINY, tie_word_embeddings=tie, **over)
    if family == "qwen3_moe":
        kwargs.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True)
        kwargs.update(over)
    config = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # norms start at 1: randomise them so a swapped norm is visible
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    t, _, d = x.shape
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], -1)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()


def reference_logits(
    shards: Sequence[Mapping[str, torch.Tensor]], arch: Any, ids: torch.Tensor
) -> torch.Tensor:
    """Logits ``[T, vocab]`` of one sequence from Megatron-layout state dicts (one per TP rank)."""
    tp = len(shards)
    emb = torch.cat([s["embedding.word_embeddings.weight"] for s in shards])
    x = emb[ids]
    ng, hpg, d = arch.num_kv_heads // tp, arch.heads_per_group, arch.head_dim
    T = ids.shape[0]
    for layer in range(arch.num_layers):
        p = f"decoder.layers.{layer}."
        h = _rms(x, shards[0][p + "input_layernorm.weight"], arch.rms_norm_eps)
        attn_out = torch.zeros_like(x)
        for s in shards:
            qkv = h @ s[p + "self_attention.linear_qkv.weight"].T
            if arch.qkv_bias:
                qkv = qkv + s[p + "self_attention.linear_qkv.bias"]
            qkv = qkv.view(T, ng, hpg + 2, d)
            q = qkv[:, :, :hpg].reshape(T, ng * hpg, d)
            k, v = qkv[:, :, hpg], qkv[:, :, hpg + 1]
            if arch.qk_norm:
                q = _rms(q, s[p + "self_attention.q_layernorm.weight"], arch.rms_norm_eps)
                k = _rms(k, s[p + "self_attention.k_layernorm.weight"], arch.rms_norm_eps)
            q, k = _rope(q, arch.rope_theta), _rope(k, arch.rope_theta)
            k, v = k.repeat_interleave(hpg, 1), v.repeat_interleave(hpg, 1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
            scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            ctx = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, -1)
            attn_out = attn_out + ctx @ s[p + "self_attention.linear_proj.weight"].T
        x = x + attn_out
        h = _rms(x, shards[0][p + "pre_mlp_layernorm.weight"], arch.rms_norm_eps)
        if arch.is_moe_layer(layer):
            x = x + _moe(h, shards[0], p, arch)
            continue
        mlp_out = torch.zeros_like(x)
        for s in shards:
            gate, up = (h @ s[p + "mlp.linear_fc1.weight"].T).chunk(2, -1)
            act = torch.nn.functional.silu(gate) * up
            mlp_out = mlp_out + act @ s[p + "mlp.linear_fc2.weight"].T
        x = x + mlp_out
    x = _rms(x, shards[0]["decoder.final_layernorm.weight"], arch.rms_norm_eps)
    head = "embedding.word_embeddings.weight" if arch.tie_embeddings else "output_layer.weight"
    return (x @ torch.cat([s[head] for s in shards]).T)[:, : arch.vocab_size]


def _moe(h: torch.Tensor, s: Mapping[str, torch.Tensor], p: str, arch: Any) -> torch.Tensor:
    probs = (h @ s[p + "mlp.router.weight"].T).softmax(-1)
    top, idx = probs.topk(arch.moe.top_k, dim=-1)
    if arch.moe.norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(h)
    for j in range(arch.moe.num_experts):
        e = f"{p}mlp.experts.local_experts.{j}."
        gate, up = (h @ s[e + "linear_fc1.weight"].T).chunk(2, -1)
        y = (torch.nn.functional.silu(gate) * up) @ s[e + "linear_fc2.weight"].T
        weight = (top * (idx == j)).sum(-1, keepdim=True)
        out = out + weight * y
    return out


@pytest.fixture
def hf_model_factory() -> Callable[..., Any]:
    return make_hf_model


@pytest.fixture
def mcore_reference() -> Callable[..., torch.Tensor]:
    return reference_logits

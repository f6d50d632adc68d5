"""Fixtures for the Megatron backend tests: tiny random HF models and a reference forward pass.

`reference_logits` runs a decoder written directly against Megatron's tensor layout (fused QKV by
query group, fc1 = [gate; up], router + experts; multi-latent attention and DeepSeek's sigmoid
router with megatron's semantics) with plain torch, optionally over tensor-parallel shards
(partial sums of row-parallel outputs, as Megatron's all-reduce does). Comparing it with the HF
model proves the conversion keeps the function, not only that it is invertible.
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


DEEPSEEK_TINY = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
                 "moe_intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 4,
                 "num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 16,
                 "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
                 "n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
                 "n_shared_experts": 1, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
                 "norm_topk_prob": True, "max_position_embeddings": 64, "rms_norm_eps": 1e-6}


def make_hf_model(family: str, *, tie: bool = False, seed: int = 0, **over: Any) -> Any:
    """A tiny random HF causal LM of ``family`` (float32, eval mode), built from config."""
    import transformers

    cfg_cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
               "llama": transformers.LlamaConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
               "deepseek_v3": transformers.DeepseekV3Config}[family]
    kwargs = dict(TINY, tie_word_embeddings=tie, **over)
    if family == "deepseek_v3":
        kwargs = dict(DEEPSEEK_TINY, tie_word_embeddings=tie, **over)
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
        for name, b in model.named_buffers():  # DeepSeek's routing bias starts at 0 too
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.1)
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
        if arch.mla is not None:
            attn_out = _mla(h, shards[0], p, arch)
        for s in shards if arch.mla is None else ():
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


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                      ) -> torch.Tensor:
    T = q.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, -1)


def _mla(h: torch.Tensor, s: Mapping[str, torch.Tensor], p: str, arch: Any) -> torch.Tensor:
    """Multi-latent attention as megatron computes it (rotary dims read pairwise)."""
    m, a, T = arch.mla, p + "self_attention.", h.shape[0]
    if m.q_lora_rank:
        q_lat = _rms(h @ s[a + "linear_q_down_proj.weight"].T, s[a + "q_layernorm.weight"],
                     arch.rms_norm_eps)
        q = q_lat @ s[a + "linear_q_up_proj.weight"].T
    else:
        q = h @ s[a + "linear_q_proj.weight"].T
    q = q.view(T, arch.num_heads, m.qk_head_dim)
    kv_lat, k_rope = (h @ s[a + "linear_kv_down_proj.weight"].T).split(
        [m.kv_lora_rank, m.qk_rope_head_dim], -1)
    kv = _rms(kv_lat, s[a + "kv_layernorm.weight"], arch.rms_norm_eps)
    kv = (kv @ s[a + "linear_kv_up_proj.weight"].T).view(T, arch.num_heads, -1)
    k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], -1)

    def rope(x: torch.Tensor) -> torch.Tensor:
        return _rope(torch.cat([x[..., 0::2], x[..., 1::2]], -1), arch.rope_theta)

    q = torch.cat([q[..., : m.qk_nope_head_dim], rope(q[..., m.qk_nope_head_dim:])], -1)
    k_rope = rope(k_rope[:, None, :]).expand(-1, arch.num_heads, -1)
    k = torch.cat([k_nope, k_rope], -1)
    ctx = _causal_attention(q, k, v, m.qk_head_dim**-0.5)
    return ctx @ s[a + "linear_proj.weight"].T


def _route(h: torch.Tensor, s: Mapping[str, torch.Tensor], p: str, arch: Any
           ) -> tuple[torch.Tensor, torch.Tensor]:
    moe = arch.moe
    logits = h @ s[p + "mlp.router.weight"].T
    if moe.score_function == "softmax":
        top, idx = logits.softmax(-1).topk(moe.top_k, dim=-1)
        return (top / top.sum(-1, keepdim=True) if moe.norm_topk_prob else top), idx
    scores = logits.sigmoid()  # DeepSeek-V3: the bias picks the experts, not their weights
    choice = scores + s[p + "mlp.router.expert_bias"]
    if moe.num_groups:
        grouped = choice.view(-1, moe.num_groups, moe.num_experts // moe.num_groups)
        best = grouped.topk(moe.top_k // moe.group_topk, -1)[0].sum(-1).topk(moe.group_topk, -1)[1]
        keep = torch.zeros_like(grouped[..., 0]).scatter(1, best, 1.0).bool()
        choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], 1), float("-inf"))
    idx = choice.topk(moe.top_k, -1)[1]
    top = scores.gather(1, idx)
    return top / top.sum(-1, keepdim=True) * moe.scaling_factor, idx


def _moe(h: torch.Tensor, s: Mapping[str, torch.Tensor], p: str, arch: Any) -> torch.Tensor:
    top, idx = _route(h, s, p, arch)
    out = torch.zeros_like(h)
    if arch.moe.shared_expert_ffn:
        gate, up = (h @ s[p + "mlp.shared_experts.linear_fc1.weight"].T).chunk(2, -1)
        out = (torch.nn.functional.silu(gate) * up) @ s[p + "mlp.shared_experts.linear_fc2.weight"].T
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

"""Parameter counts and training FLOPs per token of a `ModelArch`, for MFU (pure Python).

``matmul_params`` counts the weights a token multiplies through (the LM head included, the
embedding lookup not; for MoE only the ``top_k`` routed experts). Training FLOPs per token:

- ``6N``: ``6 * matmul_params`` (forward 2N, backward 4N);
- with attention: ``6N + 3 * 2 * layers * heads * (d_qk + d_v) * s_ctx`` where ``s_ctx`` is the
  mean number of keys a query sees: ``(s + 1) / 2`` for causal attention over sequences of length
  s, and ``d_qk = d_v = head_dim`` except under multi-latent attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from palaestra.trainers.megatron.arch import ModelArch


@dataclass(frozen=True)
class ParamCount:
    total: int  # stored parameters, as the HF model reports them (tied head counted once)
    matmul: int  # weights multiplied per token (active experts only)


def _attention_params(arch: ModelArch) -> tuple[int, int]:
    """(matmul weights, other weights: biases and norms) of one attention block."""
    h, d = arch.hidden_size, arch.head_dim
    mla = arch.mla
    if mla is None:
        attn = h * arch.q_size + 2 * h * arch.kv_size + arch.q_size * h
        extra = (arch.q_size + 2 * arch.kv_size if arch.qkv_bias else 0) + (
            2 * d if arch.qk_norm else 0
        )
        return attn, extra
    heads = arch.num_heads
    q_out = heads * mla.qk_head_dim
    q = h * mla.q_lora_rank + mla.q_lora_rank * q_out if mla.q_lora_rank else h * q_out
    kv = h * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank * heads * (
        mla.qk_nope_head_dim + mla.v_head_dim)
    norms = (mla.q_lora_rank or 0) + mla.kv_lora_rank
    return q + kv + heads * mla.v_head_dim * h, norms


def param_count(arch: ModelArch) -> ParamCount:
    """Stored and per-token-active parameters of the model (buffers such as a router's expert
    bias are not parameters, as in HF's count)."""
    h = arch.hidden_size
    attn, attn_extra = _attention_params(arch)
    dense_mlp = 3 * h * arch.ffn_hidden_size
    total = matmul = 0
    for layer in range(arch.num_layers):
        total += attn + attn_extra + 2 * h
        matmul += attn
        if arch.is_moe_layer(layer):
            assert arch.moe is not None
            expert = 3 * h * arch.moe.ffn_hidden_size
            shared = 3 * h * arch.moe.shared_expert_ffn
            total += arch.moe.num_experts * (expert + h) + shared
            matmul += arch.moe.top_k * expert + arch.moe.num_experts * h + shared
        else:
            total += dense_mlp
            matmul += dense_mlp
    head = arch.vocab_size * h
    total += head + h + (0 if arch.tie_embeddings else head)
    matmul += head
    return ParamCount(total=total, matmul=matmul)


def train_flops_per_token(arch: ModelArch, seq_len: int, *, attention: bool = True) -> float:
    """Training FLOPs (forward + backward) per token at sequence length ``seq_len``."""
    flops = 6.0 * param_count(arch).matmul
    if attention:
        s_ctx = (seq_len + 1) / 2
        d_qk, d_v = arch.attention_dims
        flops += 3 * 2.0 * arch.num_layers * arch.num_heads * (d_qk + d_v) * s_ctx
    return flops

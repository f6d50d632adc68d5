"""Parameter counts and training FLOPs per token of a `ModelArch`, for MFU (pure Python).

``matmul_params`` counts the weights a token multiplies through (the LM head included, the
embedding lookup not; for MoE only the ``top_k`` routed experts). Training FLOPs per token:

- ``6N``: ``6 * matmul_params`` (forward 2N, backward 4N);
- with attention: ``6N + 3 * 4 * layers * heads * head_dim * s_ctx`` where ``s_ctx`` is the mean
  number of keys a query sees: ``(s + 1) / 2`` for causal attention over sequences of length s.
"""

from __future__ import annotations

from dataclasses import dataclass

from palaestra.trainers.megatron.arch import ModelArch


@dataclass(frozen=True)
class ParamCount:
    total: int  # stored parameters, as the HF model reports them (tied head counted once)
    matmul: int  # weights multiplied per token (active experts only)


def param_count(arch: ModelArch) -> ParamCount:
    """Stored and per-token-active parameters of the model."""
    h, d = arch.hidden_size, arch.head_dim
    attn = h * arch.q_size + 2 * h * arch.kv_size + arch.q_size * h
    attn_extra = (arch.q_size + 2 * arch.kv_size if arch.qkv_bias else 0) + (
        2 * d if arch.qk_norm else 0
    )
    dense_mlp = 3 * h * arch.ffn_hidden_size
    total = matmul = 0
    for layer in range(arch.num_layers):
        total += attn + attn_extra + 2 * h
        matmul += attn
        if arch.is_moe_layer(layer):
            assert arch.moe is not None
            expert = 3 * h * arch.moe.ffn_hidden_size
            total += arch.moe.num_experts * (expert + h)
            matmul += arch.moe.top_k * expert + arch.moe.num_experts * h
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
        flops += 3 * 4.0 * arch.num_layers * arch.num_heads * arch.head_dim * s_ctx
    return flops

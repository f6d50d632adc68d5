"""The Llama-family forward of bitwise on-policy mode, shared by the engine and the trainer.

One function computes the hidden states of any set of tokens, each given as (sequence, position),
from weights in the engine's fused layout (`BitwiseWeights`): the embedded engine calls it for a
decode step (one token per running slot), a prefill chunk (the new tokens of several requests
after their cached prefixes) or a whole sequence, with its slot KV cache as the key/value store;
the torch trainer backend calls it for a packed micro-batch, with the policy's parameters fused
the same way (``torch.cat`` keeps them differentiable) and a fresh key/value buffer. Every step is
a `palaestra.engines.bitwise.invariant` operation, so a token's logits have the same bits on both
sides, whatever else shares its batch (`tests/engines/test_bitwise.py`).

The maths is `palaestra.engines.local.model.Decoder`'s (RMSNorm, rotary embeddings from the
model's own tables, grouped-query attention, SwiGLU; Qwen3's q/k norms and Qwen2's biases);
the differences are rounding only: separate residual adds instead of ``addmm``, the norm's mean
from an ordered sum, attention in key blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from palaestra.engines.bitwise import invariant as inv

if TYPE_CHECKING:
    import torch

    from palaestra.engines.bitwise.decoder_config import DecoderConfig
    from palaestra.engines.local.kv_cache import SlotKVCache


class LayerWeights(Protocol):
    """One decoder layer's tensors in the fused layout (`palaestra.engines.local.model`)."""

    in_norm: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_w: torch.Tensor
    post_norm: torch.Tensor

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class FusedLayer:
    """A `LayerWeights` built from separate projections (the trainer's side)."""

    in_norm: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_w: torch.Tensor
    post_norm: torch.Tensor
    gate_up_w: torch.Tensor
    down_w: torch.Tensor

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up_w, self.down_w


@dataclass
class BitwiseWeights:
    """Everything the forward reads: shapes, the fused weights, the rotary tables."""

    config: DecoderConfig
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    layers: Sequence[LayerWeights]
    cos: torch.Tensor  # [max_positions, head_dim] in the weights' dtype
    sin_signed: torch.Tensor  # sin with the first half negated (rotate_half folded in)


class KVStore(Protocol):
    """Where a layer's new keys and values go, and the keys and values attention reads."""

    def write(self, layer: int, seq: torch.Tensor, pos: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v [N, Hkv, D]`` at (seq, pos); return keys, values ``[S, Hkv, L, D]``."""
        ...


class SlotCacheStore:
    """The engine's `SlotKVCache`: sequence = cache slot, written in place."""

    def __init__(self, cache: SlotKVCache) -> None:
        self.k: torch.Tensor = cache.k  # [layers, slots, kv heads, length, head dim]
        self.v: torch.Tensor = cache.v

    def write(self, layer: int, seq: torch.Tensor, pos: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k[layer][seq, :, pos] = k
        self.v[layer][seq, :, pos] = v
        return self.k[layer], self.v[layer]


class PackedStore:
    """Fresh zero buffers of ``sequences x length`` positions per layer, filled out of place so
    autograd sees the writes (the trainer's side)."""

    def __init__(self, sequences: int, length: int) -> None:
        self.sequences = sequences
        self.length = length

    def write(self, layer: int, seq: torch.Tensor, pos: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.sequences, self.length, *k.shape[1:])
        keys = k.new_zeros(shape).index_put((seq, pos), k)
        values = v.new_zeros(shape).index_put((seq, pos), v)
        return keys.transpose(1, 2), values.transpose(1, 2)


def hidden_states(w: BitwiseWeights, tokens: torch.Tensor, seq: torch.Tensor,
                  pos: torch.Tensor, store: KVStore, plan: inv.AttentionPlan | None = None
                  ) -> torch.Tensor:
    """The last hidden states ``[N, hidden]`` (before the final norm) of ``tokens [N]``, token
    ``i`` at position ``pos[i]`` of sequence ``seq[i]``, attending to what ``store`` holds of
    its sequence up to its position (earlier tokens of this call included). ``plan``: the
    attention tiles when the caller has them (a decode step's `invariant.decode_plan`)."""
    c = w.config
    n = tokens.shape[0]
    heads, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
    q_dim, kv_dim = heads * d, hkv * d
    scale = d**-0.5
    cos = w.cos[pos].unsqueeze(1)
    sin = w.sin_signed[pos].unsqueeze(1)
    h = w.embed[tokens]
    if plan is None:  # the same for every layer
        plan = inv.attention_plan(seq, pos, heads, hkv)
    for i, layer in enumerate(w.layers):
        x = inv.rms_norm(h, layer.in_norm, c.rms_norm_eps)
        qkv = inv.linear(x, layer.qkv_w, layer.qkv_b)
        q = qkv[:, :q_dim].reshape(n, heads, d)
        k = qkv[:, q_dim : q_dim + kv_dim].reshape(n, hkv, d)
        v = qkv[:, q_dim + kv_dim :].reshape(n, hkv, d)
        if layer.q_norm is not None and layer.k_norm is not None:
            q = inv.rms_norm(q, layer.q_norm, c.rms_norm_eps)
            k = inv.rms_norm(k, layer.k_norm, c.rms_norm_eps)
        q, k = inv.rope(q, cos, sin), inv.rope(k, cos, sin)
        keys, values = store.write(i, seq, pos, k, v)
        attn = inv.attention(q, keys, values, plan, scale)
        h = h + inv.linear(attn, layer.o_w)
        x = inv.rms_norm(h, layer.post_norm, c.rms_norm_eps)
        gate_up_w, down_w = layer.dense()
        gate, up = inv.linear(x, gate_up_w).chunk(2, dim=-1)
        h = h + inv.linear(inv.silu_mul(gate, up), down_w)
    return h


def logits(w: BitwiseWeights, h: torch.Tensor) -> torch.Tensor:
    """Float32 logits ``[N, V]`` of hidden states ``[N, hidden]`` (final norm, output layer)."""
    import torch

    x = inv.rms_norm(h, w.final_norm, w.config.rms_norm_eps)
    return inv.linear(x, w.lm_head, out_dtype=torch.float32).float()


__all__ = ["BitwiseWeights", "FusedLayer", "KVStore", "LayerWeights", "PackedStore",
           "SlotCacheStore", "hidden_states", "logits"]

"""Rotary embeddings of a packed micro-batch read at each token's own position.

Without transformer-engine, megatron applies RoPE to a packed ("thd") row one sequence at a time
(a slice, six element-wise kernels and a copy per sequence, per layer, for q and for k): an RL
micro-batch of ~40 sequences of ~200 tokens launched ~30k tiny kernels per forward. When the
rotary table handed to the layers has one row per *token* (``freqs.size(0)`` equals the packed
length), megatron takes its exact-mapping path instead: one rotation over the whole row.
`install` makes the model's rotary module return that table, gathered at the position ids that
`set_positions` gives it before each forward (positions restart at 0 in every sequence, so the
result is the per-sequence one, bit for bit).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def install(gpt_model: Any) -> bool:
    """Wrap ``gpt_model.rotary_pos_emb.forward``; False (nothing done) for models without plain
    RoPE (multi-latent attention computes its own)."""
    rope = getattr(gpt_model, "rotary_pos_emb", None)
    if rope is None or getattr(gpt_model.config, "multi_latent_attention", False) \
            or getattr(rope, "palaestra_packed", False):
        return False
    inner = rope.forward

    def forward(max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group: Any = None) -> torch.Tensor:
        emb = inner(max_seq_len, offset, packed_seq, cp_group)  # [max_len, 1, 1, dim]
        positions = rope.palaestra_positions
        if not packed_seq or positions is None:
            return emb
        return emb[positions]  # [tokens, 1, 1, dim]: megatron's exact-mapping THD path

    rope.forward = forward
    rope.palaestra_packed = True
    rope.palaestra_positions = None
    return True


def set_positions(gpt_model: Any, positions: torch.Tensor | None) -> None:
    """Position id of every packed token (``[tokens]``, on the device) for the next forward."""
    rope = getattr(gpt_model, "rotary_pos_emb", None)
    if rope is not None and getattr(rope, "palaestra_packed", False):
        rope.palaestra_positions = positions

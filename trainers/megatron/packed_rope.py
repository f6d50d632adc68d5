"""Rotary embeddings of a packed micro-batch read at each token's own position.

Without transformer-engine, megatron applies RoPE to a packed ("thd") row one sequence at a time
(a slice, six element-wise kernels and a copy per sequence, per layer, for q and for k): an RL
micro-batch of ~40 sequences of ~200 tokens launched ~30k tiny kernels per forward. When the
rotary table handed to the layers has one row per *token* (``freqs.size(0)`` equals the packed
length), megatron takes its exact-mapping path instead: one rotation over the whole row.
`install` makes the model's rotary module return that table, gathered at the position ids that
`set_positions` gives it before each forward (positions restart at 0 in every sequence, so the
result is the per-sequence one, bit for bit).

megatron-core (0.19 measured) still walks that exact-mapping path one sequence at a time: a
``cu_seqlens[i].item()`` (a host sync) and a slice per sequence, per layer, for q and for k, then
concatenates the slices back. On one context-parallel rank the slices are consecutive and cover
the table, so the concatenation *is* the table: `install` also routes that case straight to the
one rotation (cProfile on an H200, Qwen3-0.6B shape, 4 packs of ~64 sequences: 0.60 s of a 0.92 s
train step went to that loop, 14,336 calls of megatron's per-sequence slice).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def install(gpt_model: torch.nn.Module) -> bool:
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
    _route_exact_mapping_to_one_rotation()
    return True


def _route_exact_mapping_to_one_rotation() -> None:
    """Wrap megatron's THD RoPE: a per-token table on one CP rank is rotated in one call (the
    same arithmetic as its per-sequence loop, without a host sync per sequence); every other
    case goes to megatron's own function unchanged."""
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils._apply_rotary_pos_emb_thd
    if getattr(original, "palaestra_one_rotation", False):
        return
    rotate_bshd = rope_utils._apply_rotary_pos_emb_bshd

    def apply_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, *args: Any,
                  cp_group: Any = None, **kwargs: Any) -> torch.Tensor:
        # megatron splits t by cu_seqlens, so t.size(0) == cu_seqlens[-1]: a table of that many
        # rows is its exact-mapping case, whose slices concatenate back to the table here
        if (not args and cp_group is not None and cp_group.size() == 1 and freqs.dim() >= 1
                and freqs.size(0) == t.size(0)):
            return rotate_bshd(t.unsqueeze(1), freqs, **kwargs).squeeze(1)
        return original(t, cu_seqlens, freqs, *args, cp_group=cp_group, **kwargs)

    apply_thd.palaestra_one_rotation = True  # type: ignore[attr-defined]
    rope_utils._apply_rotary_pos_emb_thd = apply_thd


def set_positions(gpt_model: torch.nn.Module, positions: torch.Tensor | None) -> None:
    """Position id of every packed token (``[tokens]``, on the device) for the next forward."""
    rope = getattr(gpt_model, "rotary_pos_emb", None)
    if rope is not None and getattr(rope, "palaestra_packed", False):
        rope.palaestra_positions = positions

"""Multi-latent attention (DeepSeek-V2/V3) parts of the HF <-> Megatron conversion.

Megatron names inside ``decoder.layers.{i}.self_attention.`` (local layer spec) and their HF
counterparts inside ``model.layers.{i}.self_attn.``: ``linear_q_down_proj`` = ``q_a_proj``,
``q_layernorm`` = ``q_a_layernorm``, ``linear_q_up_proj`` = ``q_b_proj`` (or ``linear_q_proj`` =
``q_proj`` without a q LoRA), ``linear_kv_down_proj`` = ``kv_a_proj_with_mqa``, ``kv_layernorm`` =
``kv_a_layernorm``, ``linear_kv_up_proj`` = ``kv_b_proj``, ``linear_proj`` = ``o_proj``. Row
layouts agree (per head ``[nope; rope]`` for q, ``[k_nope; v]`` for kv, ``[latent; k_rope]`` for
the kv down projection) with one exception: megatron's MLA always reads the rotary dims
pairwise-interleaved (``x[0::2], x[1::2]``), as HF does with ``rope_interleave=True``. For
``rope_interleave=False`` checkpoints the rotary rows are interleaved on the way in and
de-interleaved on the way out, so both compute the same rotation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from palaestra.trainers.megatron.arch import ModelArch

MLA_TO_HF = {
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
}
_ROTARY_Q = ("self_attention.linear_q_proj.weight", "self_attention.linear_q_up_proj.weight")
_ROTARY_KV = "self_attention.linear_kv_down_proj.weight"


def interleave_rows(rows: torch.Tensor) -> torch.Tensor:
    """Half layout ``[x_0..x_{r/2-1}; y_0..]`` -> pairwise ``[x_0; y_0; x_1; y_1; ...]``."""
    half = rows.shape[0] // 2
    return rows.reshape(2, half, *rows.shape[1:]).transpose(0, 1).reshape(rows.shape)


def deinterleave_rows(rows: torch.Tensor) -> torch.Tensor:
    """Inverse of `interleave_rows`."""
    import torch

    return torch.cat([rows[0::2], rows[1::2]], dim=0)


def _permute_rotary(name: str, tensor: torch.Tensor, arch: ModelArch,
                    permute: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Apply ``permute`` to the rotary rows of a q or kv-down projection (else return as is)."""
    import torch

    mla = arch.mla
    assert mla is not None
    rope = mla.qk_rope_head_dim
    if name in _ROTARY_Q:
        heads = tensor.reshape(-1, mla.qk_head_dim, tensor.shape[-1])
        parts = [torch.cat([h[: mla.qk_nope_head_dim], permute(h[mla.qk_nope_head_dim:])])
                 for h in heads]
        return torch.stack(parts).reshape(tensor.shape)
    if name == _ROTARY_KV:
        return torch.cat([tensor[:-rope], permute(tensor[-rope:])])
    return tensor


def mcore_mla_param_to_hf(rest: str, tensor: torch.Tensor, hf_prefix: str, arch: ModelArch
                          ) -> list[tuple[str, torch.Tensor]] | None:
    """The HF pair of an MLA parameter named ``rest`` inside a layer, or None if not one."""
    hf = MLA_TO_HF.get(rest)
    if hf is None or arch.mla is None:
        return None
    if not arch.mla.rope_interleave:
        tensor = _permute_rotary(rest, tensor, arch, deinterleave_rows)
    return [(hf_prefix + hf, tensor)]


def hf_mla_layer_to_mcore(take: Callable[[str], torch.Tensor], arch: ModelArch, layer: int
                          ) -> dict[str, torch.Tensor]:
    """Megatron tensors of one layer's attention, read through ``take(hf_name)``."""
    assert arch.mla is not None
    skip = ({"self_attention.linear_q_proj.weight"} if arch.mla.q_lora_rank
            else {"self_attention.linear_q_down_proj.weight", "self_attention.q_layernorm.weight",
                  "self_attention.linear_q_up_proj.weight"})
    out: dict[str, torch.Tensor] = {}
    for rest, hf in MLA_TO_HF.items():
        if rest in skip:
            continue
        tensor = take(f"model.layers.{layer}.{hf}")
        if not arch.mla.rope_interleave:
            tensor = _permute_rotary(rest, tensor, arch, interleave_rows)
        out[f"decoder.layers.{layer}.{rest}"] = tensor
    return out


__all__ = ["MLA_TO_HF", "deinterleave_rows", "hf_mla_layer_to_mcore", "interleave_rows",
           "mcore_mla_param_to_hf"]

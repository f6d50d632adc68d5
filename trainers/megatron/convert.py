"""HF <-> Megatron-core weight conversion (Qwen2, Qwen3, Llama, Qwen3-MoE, DeepSeek-V3), pure tensors.

Nothing here imports megatron: the functions reshuffle torch tensors on any device, so the CPU
tests check them against a real HF model's state dict and the GPU weight sync reuses them.

Layouts (Megatron names are those of `GPTModel.state_dict()`, unsharded, PP=1):
- fused QKV: rows grouped by query group, ``[q heads of group g; k_g; v_g]`` for g in groups;
- gated MLP: ``linear_fc1 = [gate; up]``;
- tied embeddings: no ``output_layer.weight`` and no HF ``lm_head.weight`` (HF checkpoints omit it);
- the vocabulary may be padded on the Megatron side (rows of zeros), sliced off on export;
- ``fused_norms=True`` names the norms as transformer-engine's fused layernorm-linear modules do.

HF names are those of the on-disk checkpoint (what engines load); for MoE that is one tensor per
expert. `convert_moe` handles routers, experts (and transformers-5's in-memory fused expert
tensors), `convert_mla` multi-latent attention.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from palaestra.errors import ConfigError
from palaestra.trainers.megatron import convert_mla, convert_moe
from palaestra.trainers.megatron.arch import ModelArch

if TYPE_CHECKING:
    import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# a critic's value head: Megatron's replaced output layer <-> HF *ForTokenClassification's score
VALUE_HEAD = {"output_layer.weight": "score.weight", "output_layer.bias": "score.bias"}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Interleave q, k, v (weights [out, in] or biases [out]) by query group, as Megatron stores.

    Works on TP shards too: pass the shard's q/k/v and its number of kv heads.
    """
    import torch

    rest = q.shape[1:]
    q_g = q.reshape(num_kv_heads, -1, *rest)
    k_g = k.reshape(num_kv_heads, -1, *rest)
    v_g = v.reshape(num_kv_heads, -1, *rest)
    return torch.cat([q_g, k_g, v_g], dim=1).reshape(-1, *rest)


def split_qkv(
    qkv: torch.Tensor, num_kv_heads: int, heads_per_group: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`: the Megatron fused tensor back to (q, k, v)."""
    rest = qkv.shape[1:]
    grouped = qkv.reshape(num_kv_heads, (heads_per_group + 2) * head_dim, *rest)
    q_rows = heads_per_group * head_dim
    q = grouped[:, :q_rows].reshape(-1, *rest)
    k = grouped[:, q_rows : q_rows + head_dim].reshape(-1, *rest)
    v = grouped[:, q_rows + head_dim :].reshape(-1, *rest)
    return q, k, v


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    if t.shape[0] > rows:
        raise ConfigError(f"padded vocab {rows} is smaller than the HF vocab {t.shape[0]}")
    pad = t.new_zeros((rows - t.shape[0], *t.shape[1:]))
    import torch

    return torch.cat([t, pad], dim=0)


def _norm_names(fused_norms: bool, moe_layer: bool) -> tuple[str, str]:
    """(input norm, pre-MLP norm) Megatron suffixes inside a layer."""
    if not fused_norms:
        return "input_layernorm.weight", "pre_mlp_layernorm.weight"
    # TE fuses the norm into the following linear; an MoE layer's norm stays a separate module.
    pre_mlp = "pre_mlp_layernorm.weight" if moe_layer else "mlp.linear_fc1.layer_norm_weight"
    return "self_attention.linear_qkv.layer_norm_weight", pre_mlp


def mcore_to_hf_param(
    name: str,
    tensor: torch.Tensor,
    arch: ModelArch,
    *,
    layer_offset: int = 0,
    expert_offset: int = 0,
) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs for one full (TP-gathered) Megatron parameter.

    ``layer_offset`` is the first global layer of this pipeline stage; ``expert_offset`` the first
    global expert held by this expert-parallel rank. Returns [] for state that HF does not have
    (transformer-engine ``_extra_state``). Raises ConfigError for an unknown name.
    """
    if name.endswith("_extra_state"):
        return []
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", tensor[: arch.vocab_size])]
    if arch.value_head and name in VALUE_HEAD:
        return [(VALUE_HEAD[name], tensor)]
    if name == "output_layer.weight":
        if arch.tie_embeddings:
            return []
        return [("lm_head.weight", tensor[: arch.vocab_size])]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", tensor)]
    match = _LAYER.match(name)
    if match is None:
        raise ConfigError(f"unknown Megatron parameter {name!r}")
    layer = int(match.group(1)) + layer_offset
    rest = match.group(2)
    pre = f"model.layers.{layer}."
    if rest in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"):
        return [(pre + "input_layernorm.weight", tensor)]
    if rest in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"):
        return [(pre + "post_attention_layernorm.weight", tensor)]
    mla = convert_mla.mcore_mla_param_to_hf(rest, tensor, pre, arch)
    if mla is not None:
        return mla
    if rest.startswith("self_attention.linear_qkv."):
        kind = rest.rsplit(".", 1)[1]  # weight | bias
        q, k, v = split_qkv(tensor, arch.num_kv_heads, arch.heads_per_group, arch.head_dim)
        attn = pre + "self_attn."
        return [(f"{attn}q_proj.{kind}", q), (f"{attn}k_proj.{kind}", k),
                (f"{attn}v_proj.{kind}", v)]
    if rest == "self_attention.linear_proj.weight":
        return [(pre + "self_attn.o_proj.weight", tensor)]
    if rest == "self_attention.q_layernorm.weight":
        return [(pre + "self_attn.q_norm.weight", tensor)]
    if rest == "self_attention.k_layernorm.weight":
        return [(pre + "self_attn.k_norm.weight", tensor)]
    if rest == "mlp.linear_fc1.weight":
        gate, up = tensor.chunk(2, dim=0)
        return [(pre + "mlp.gate_proj.weight", gate), (pre + "mlp.up_proj.weight", up)]
    if rest == "mlp.linear_fc2.weight":
        return [(pre + "mlp.down_proj.weight", tensor)]
    moe = convert_moe.mcore_moe_param_to_hf(rest, tensor, pre, expert_offset)
    if moe is not None:
        return moe
    raise ConfigError(f"unknown Megatron parameter {name!r}")


def mcore_to_hf(
    mcore_sd: Mapping[str, torch.Tensor], arch: ModelArch, *, layer_offset: int = 0
) -> dict[str, torch.Tensor]:
    """Full Megatron state dict -> HF checkpoint-layout state dict (tensors may be views)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in mcore_sd.items():
        for hf_name, hf_tensor in mcore_to_hf_param(name, tensor, arch, layer_offset=layer_offset):
            out[hf_name] = hf_tensor
    return out


def iter_mcore_to_hf(
    named_tensors: Iterable[tuple[str, torch.Tensor]], arch: ModelArch, *, layer_offset: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Streaming form of `mcore_to_hf`, for bucketed weight sync."""
    for name, tensor in named_tensors:
        yield from mcore_to_hf_param(name, tensor, arch, layer_offset=layer_offset)


def _beyond_last_layer(hf_name: str, num_layers: int) -> bool:
    match = _HF_LAYER.match(hf_name)
    return match is not None and int(match.group(1)) >= num_layers


def _hf_gqa_layer_to_mcore(take: Callable[[str], torch.Tensor], arch: ModelArch, layer: int
                           ) -> dict[str, torch.Tensor]:
    """Megatron tensors of one layer's grouped-query attention, read through ``take``."""
    pre, attn = f"decoder.layers.{layer}.self_attention.", f"model.layers.{layer}.self_attn."
    out: dict[str, torch.Tensor] = {}
    for kind in ("weight", "bias") if arch.qkv_bias else ("weight",):
        out[f"{pre}linear_qkv.{kind}"] = fuse_qkv(
            take(f"{attn}q_proj.{kind}"), take(f"{attn}k_proj.{kind}"),
            take(f"{attn}v_proj.{kind}"), arch.num_kv_heads,
        )
    out[pre + "linear_proj.weight"] = take(attn + "o_proj.weight")
    if arch.qk_norm:
        out[pre + "q_layernorm.weight"] = take(attn + "q_norm.weight")
        out[pre + "k_layernorm.weight"] = take(attn + "k_norm.weight")
    return out


def hf_to_mcore(
    hf_sd: Mapping[str, torch.Tensor],
    arch: ModelArch,
    *,
    padded_vocab: int | None = None,
    fused_norms: bool = False,
    grouped_experts: bool = False,
) -> dict[str, torch.Tensor]:
    """HF state dict -> full Megatron state dict; every HF tensor must be used exactly once.

    Accepts checkpoint-layout or transformers-5 fused-expert MoE tensors, and an HF dict with or
    without ``lm_head.weight`` for tied models. ``grouped_experts`` selects the grouped-GEMM
    expert names (``experts.linear_fc1.weight{j}``) over SequentialMLP's.
    """
    src = dict(convert_moe.unfuse_hf_experts(hf_sd, arch)) if arch.moe else dict(hf_sd)
    if arch.mla is not None:
        if fused_norms:
            raise ConfigError("multi-latent attention with transformer-engine's layer spec is "
                              "not supported yet; set use_transformer_engine='off'")
        # DeepSeek-V3 checkpoints carry multi-token-prediction layers past num_hidden_layers,
        # which HF's model (and this backend) does not build
        src = {k: v for k, v in src.items() if not _beyond_last_layer(k, arch.num_layers)}
    if arch.tie_embeddings or arch.value_head:
        src.pop("lm_head.weight", None)  # a critic starting from a causal LM drops its head
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in src:
            raise ConfigError(f"HF state dict lacks {key!r} for a {arch.family} model")
        used.add(key)
        return src[key]

    vocab_rows = padded_vocab or arch.vocab_size
    out: dict[str, torch.Tensor] = {
        "embedding.word_embeddings.weight": _pad_rows(take("model.embed_tokens.weight"), vocab_rows)
    }
    for layer in range(arch.num_layers):
        pre, hf = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        moe_layer = arch.is_moe_layer(layer)
        in_norm, mlp_norm = _norm_names(fused_norms, moe_layer)
        out[pre + in_norm] = take(hf + "input_layernorm.weight")
        if arch.mla is not None:
            out.update(convert_mla.hf_mla_layer_to_mcore(take, arch, layer))
        else:
            out.update(_hf_gqa_layer_to_mcore(take, arch, layer))
        out[pre + mlp_norm] = take(hf + "post_attention_layernorm.weight")
        if moe_layer:
            out.update(convert_moe.hf_moe_layer_to_mcore(take, arch, layer, grouped_experts))
        else:
            import torch

            out[pre + "mlp.linear_fc1.weight"] = torch.cat(
                [take(hf + "mlp.gate_proj.weight"), take(hf + "mlp.up_proj.weight")], dim=0
            )
            out[pre + "mlp.linear_fc2.weight"] = take(hf + "mlp.down_proj.weight")
    out["decoder.final_layernorm.weight"] = take("model.norm.weight")
    if arch.value_head:  # absent when a critic starts from a causal LM: the head keeps its init
        out.update({m: take(h) for m, h in VALUE_HEAD.items() if h in src})
    elif not arch.tie_embeddings:
        out["output_layer.weight"] = _pad_rows(take("lm_head.weight"), vocab_rows)
    unused = sorted(set(src) - used)
    if unused:
        raise ConfigError(
            f"HF state dict has {len(unused)} tensors the {arch.family} conversion does not use, "
            f"e.g. {unused[:3]}; is the config right for these weights?"
        )
    return out

"""Move weights between an HF state dict and a (TP/PP/EP-sharded) Megatron model on this rank.

`load_hf_weights` converts an HF state dict and copies this rank's shard into the model;
`iter_hf_weights` walks the model's parameters, gathers tensor- and expert-parallel shards
(all-gather over the TP / expert groups) and yields full tensors under HF names. Each pipeline
stage yields its own layers (global layer numbers).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from palaestra.errors import ConfigError
from palaestra.trainers.megatron import sharding
from palaestra.trainers.megatron.arch import ModelArch
from palaestra.trainers.megatron.convert import VALUE_HEAD, hf_to_mcore, mcore_to_hf_param

if TYPE_CHECKING:
    import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_SEQ_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)(\.)")
_GROUPED_EXPERT = re.compile(r"(\.mlp\.experts\.linear_fc[12]\.weight)(\d+)$")


def unwrap(model: Any) -> Any:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def layer_offset(model: Any) -> int:
    """Global index of this pipeline stage's first decoder layer."""
    layers = unwrap(model).decoder.layers
    return int(layers[0].layer_number) - 1 if len(layers) else 0


def _groups() -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_group(),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "tp_size": ps.get_tensor_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_group(),
        "etp_rank": ps.get_expert_tensor_parallel_rank(),
        "etp_size": ps.get_expert_tensor_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_group(),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "ep_size": ps.get_expert_model_parallel_world_size(),
    }


def globalize(name: str, layer_off: int, expert_off: int) -> str:
    """A local (stage / EP-rank) Megatron name -> its name in the full model."""
    name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_off}.", name, count=1)
    name = _SEQ_EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + expert_off}{m.group(3)}",
                           name, count=1)
    return _GROUPED_EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + expert_off}", name,
                               count=1)


def _local_experts(arch: ModelArch, ep_size: int) -> int:
    return arch.moe.num_experts // ep_size if arch.moe else 0


def _replicated(name: str, arch: ModelArch) -> bool:
    """Parameters every TP rank holds whole although their name looks sharded (value head)."""
    return arch.value_head and name in VALUE_HEAD


def load_hf_weights(
    model: Any, hf_sd: Mapping[str, torch.Tensor], arch: ModelArch, *, fused_norms: bool = False
) -> None:
    """Copy an HF state dict into this rank's part of a Megatron model (strict: all must match)."""
    import torch

    g = _groups()
    inner = unwrap(model)
    local_sd = inner.state_dict()
    grouped = any(_GROUPED_EXPERT.search(k) for k in local_sd)
    padded = inner.vocab_size if hasattr(inner, "vocab_size") else None
    full = hf_to_mcore(hf_sd, arch, padded_vocab=padded, fused_norms=fused_norms,
                       grouped_experts=grouped)
    l_off = layer_offset(inner)
    e_off = g["ep_rank"] * _local_experts(arch, g["ep_size"])
    new: dict[str, torch.Tensor] = {}
    for key, current in local_sd.items():
        if key.endswith("_extra_state"):
            continue
        gname = globalize(key, l_off, e_off)
        if gname == "output_layer.weight" and arch.tie_embeddings and not arch.value_head:
            gname = "embedding.word_embeddings.weight"  # last PP stage's copy of the embedding
        if gname not in full and _replicated(gname, arch):
            continue  # a critic started from a causal LM: the value head keeps its init
        if gname not in full:
            raise ConfigError(f"model parameter {key!r} ({gname}) has no HF counterpart")
        if _replicated(gname, arch):
            t = full[gname]
        elif sharding.is_expert_param(gname):
            t = sharding.shard_tensor(gname, full[gname], g["etp_rank"], g["etp_size"])
        else:
            t = sharding.shard_tensor(gname, full[gname], g["tp_rank"], g["tp_size"])
        if t.shape != current.shape:
            raise ConfigError(
                f"{key}: converted shape {tuple(t.shape)} != model shape {tuple(current.shape)}; "
                "does the HF config match the weights?"
            )
        new[key] = t
    with torch.no_grad():
        result = inner.load_state_dict(new, strict=False)
    missing = [k for k in result.missing_keys
               if not k.endswith("_extra_state") and not _replicated(k, arch)]
    if missing or result.unexpected_keys:
        raise ConfigError(f"weight load mismatch: missing {missing[:5]}, "
                          f"unexpected {result.unexpected_keys[:5]}")


def _all_gather(t: torch.Tensor, group: Any, size: int) -> list[torch.Tensor]:
    import torch
    import torch.distributed as dist

    t = t.contiguous()
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t, group=group)
    return out


def weight_tensors(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters plus the buffers that are weights of the HF model too (the MoE
    router's expert bias, which training moves without gradients)."""
    yield from model.named_parameters()
    for name, buf in model.named_buffers():
        if name.endswith(".router.expert_bias"):
            yield name, buf


def iter_full_params(model: Any, arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """(global Megatron name, full tensor) for every weight of this pipeline stage.

    Collective: every rank of the TP and EP groups must iterate together.
    """
    g = _groups()
    inner = unwrap(model)
    l_off = layer_offset(inner)
    local_experts = _local_experts(arch, g["ep_size"])
    for name, param in weight_tensors(inner):
        t = param.detach()
        expert = sharding.is_expert_param(name)
        size, group = (g["etp_size"], g["etp"]) if expert else (g["tp_size"], g["tp"])
        if size > 1 and sharding.tp_split_dim(name) is not None and not _replicated(name, arch):
            t = sharding.unshard_tensor(name, _all_gather(t, group, size))
        if expert and g["ep_size"] > 1:
            for rank, shard in enumerate(_all_gather(t, g["ep"], g["ep_size"])):
                yield globalize(name, l_off, rank * local_experts), shard
        else:
            yield globalize(name, l_off, g["ep_rank"] * local_experts), t


def iter_hf_weights(model: Any, arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) pairs of this pipeline stage, vocabulary padding removed."""
    for name, tensor in iter_full_params(model, arch):
        yield from mcore_to_hf_param(name, tensor, arch)

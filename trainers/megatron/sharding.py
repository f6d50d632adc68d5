"""Tensor- and expert-parallel sharding of Megatron state dicts, as pure tensor functions.

Which way a parameter splits follows from its Megatron name: column-parallel linears (fused QKV,
fc1, the vocabulary of embedding and output layer) split rows, row-parallel ones (attention
output projection, fc2) split columns, everything else (norms, router) is replicated. The gated
fc1 ``[gate; up]`` splits gate and up separately, so each rank holds ``[gate_r; up_r]`` as Megatron
does. Expert parallelism hands each rank a contiguous block of experts, renumbered from 0.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from palaestra.errors import ConfigError

if TYPE_CHECKING:
    import torch

_COLUMN = re.compile(
    r"(^embedding\.word_embeddings\.weight$|^output_layer\.weight$|\.linear_qkv\.(weight|bias)$"
    r"|\.linear_fc1\.(weight|bias)\d*$)"
)
_ROW = re.compile(r"(\.linear_proj\.weight$|\.linear_fc2\.weight\d*$)")
_GATED = re.compile(r"\.linear_fc1\.weight\d*$")
_SEQ_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")
_GROUPED_EXPERT = re.compile(r"^(.*\.mlp\.experts\.linear_fc[12]\.weight)(\d+)$")


def tp_split_dim(name: str) -> int | None:
    """0 for column-parallel, 1 for row-parallel, None for replicated parameters."""
    if name.endswith("_extra_state"):
        return None
    if _COLUMN.search(name):
        return 0
    if _ROW.search(name):
        return 1
    return None


def shard_tensor(
    name: str, tensor: torch.Tensor, rank: int, size: int, *, gated: bool = True
) -> torch.Tensor:
    """This tensor-parallel rank's slice of a full Megatron parameter."""
    dim = tp_split_dim(name)
    if dim is None or size == 1:
        return tensor
    if tensor.shape[dim] % (2 * size if gated and _GATED.search(name) else size):
        raise ConfigError(f"{name} with shape {tuple(tensor.shape)} does not split over TP={size}")
    if gated and _GATED.search(name):
        import torch

        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return tensor.chunk(size, dim=dim)[rank]


def unshard_tensor(
    name: str, shards: Sequence[torch.Tensor], *, gated: bool = True
) -> torch.Tensor:
    """Full parameter from all tensor-parallel ranks' shards (in rank order)."""
    import torch

    dim = tp_split_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if gated and _GATED.search(name):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return torch.cat(list(shards), dim=dim)


def is_expert_param(name: str) -> bool:
    """True for routed-expert weights (sharded by expert-TP, not by the dense TP size)."""
    return ".mlp.experts." in name


def shard_state_dict(
    sd: Mapping[str, torch.Tensor], size: int, *, expert_size: int | None = None
) -> list[dict[str, torch.Tensor]]:
    """Split a full Megatron state dict into ``size`` tensor-parallel state dicts.

    Expert weights split over ``expert_size`` ranks (Megatron's expert_tensor_parallel_size,
    default ``size``); with expert_size=1 every rank keeps them whole.
    """
    esize = size if expert_size is None else expert_size
    if size % esize:
        raise ConfigError(f"expert TP={esize} must divide TP={size}")
    out: list[dict[str, torch.Tensor]] = []
    for r in range(size):
        out.append({
            k: shard_tensor(k, v, r % esize, esize) if is_expert_param(k)
            else shard_tensor(k, v, r, size)
            for k, v in sd.items()
        })
    return out


def unshard_state_dicts(
    shards: Sequence[Mapping[str, torch.Tensor]], *, expert_size: int | None = None
) -> dict[str, torch.Tensor]:
    """Inverse of `shard_state_dict`."""
    esize = len(shards) if expert_size is None else expert_size
    return {
        k: unshard_tensor(k, [s[k] for s in shards[:esize]]) if is_expert_param(k)
        else unshard_tensor(k, [s[k] for s in shards])
        for k in shards[0]
    }


def _expert_match(name: str) -> tuple[str, int, str] | None:
    m = _SEQ_EXPERT.match(name)
    if m:
        return m.group(1), int(m.group(2)), m.group(3)
    m = _GROUPED_EXPERT.match(name)
    if m:
        return m.group(1), int(m.group(2)), ""
    return None


def ep_shard_state_dict(
    sd: Mapping[str, torch.Tensor], size: int, num_experts: int
) -> list[dict[str, torch.Tensor]]:
    """Split experts over ``size`` expert-parallel ranks (contiguous blocks, local numbering)."""
    if num_experts % size:
        raise ConfigError(f"{num_experts} experts do not split over EP={size}")
    local = num_experts // size
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]
    for name, tensor in sd.items():
        m = _expert_match(name)
        if m is None:
            for shard in out:
                shard[name] = tensor
            continue
        head, expert, tail = m
        out[expert // local][f"{head}{expert % local}{tail}"] = tensor
    return out


def ep_unshard_state_dicts(
    shards: Sequence[Mapping[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """Inverse of `ep_shard_state_dict` (every rank holds the same number of experts)."""
    local = 1 + max(
        (m[1] for m in map(_expert_match, shards[0]) if m is not None), default=-1
    )
    out: dict[str, torch.Tensor] = {}
    for rank, shard in enumerate(shards):
        for name, tensor in shard.items():
            m = _expert_match(name)
            if m is None:
                out.setdefault(name, tensor)
            else:
                out[f"{m[0]}{rank * local + m[1]}{m[2]}"] = tensor
    return out

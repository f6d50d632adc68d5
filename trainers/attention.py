"""Causal attention on packed and padded layouts through torch's fused kernels, shared by the torch
and Megatron backends (no megatron import).

Megatron hands core attention ``[s, b, heads, dim]`` tensors, or ``[t, heads, dim]`` for packed
sequences ("thd") with cumulative sequence lengths. These functions run
`torch.nn.functional.scaled_dot_product_attention` (flash / cuDNN / memory-efficient kernels, so
memory stays linear in sequence length) and, for packed sequences on CUDA, torch's variable-length
flash attention; elsewhere they fall back to one SDPA call per packed sequence. Grouped-query
attention is passed through to the kernels rather than materialising repeated keys.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import torch


PER_SEQUENCE_MAX = 4
"""Packs of up to this many sequences use one SDPA call per sequence under ``"auto"``."""


def use_per_sequence(mode: str, num_sequences: int) -> bool:
    """Whether a pack of ``num_sequences`` runs per-sequence SDPA under ``packed_attention``."""
    if mode == "auto":
        return num_sequences <= PER_SEQUENCE_MAX
    return mode == "per_sequence"


def sdpa_bshd(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention: q ``[s, b, hq, d]``, k/v ``[s, b, hkv, d]`` -> ``[s, b, hq * d]``."""
    import torch.nn.functional as F

    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    s, b = query.shape[0], query.shape[1]
    return out.permute(2, 0, 1, 3).reshape(s, b, -1)


@functools.cache
def _varlen_kwargs() -> dict[str, Any] | None:
    """Keyword arguments for a causal, GQA `varlen_attn` call in this torch, or None if absent."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kwargs: dict[str, Any] = {}
    if "window_size" in params:  # torch >= 2.11
        kwargs["window_size"] = (-1, 0)
    elif "is_causal" in params:  # torch 2.10
        kwargs["is_causal"] = True
    else:
        return None
    kwargs["_gqa"] = "enable_gqa" in params
    return kwargs


def _varlen(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
    max_seqlen: int, scale: float | None, kwargs: dict[str, Any],
) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    call = {k: v for k, v in kwargs.items() if k != "_gqa"}
    # flash kernels want dense rows; Megatron's q/k/v are strided views of the fused projection
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        if kwargs["_gqa"]:
            call["enable_gqa"] = True
        else:
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
    out = varlen_attn(
        query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale, **call
    )
    return cast("torch.Tensor", out)  # a tuple only with return_aux, which is never passed


def sdpa_thd(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    use_varlen: bool | None = None,
) -> torch.Tensor:
    """Causal attention within each packed sequence: q ``[t, hq, d]`` -> ``[t, hq * d]``.

    ``cu_seqlens`` (int32, ``[n + 1]``) delimits the sequences; tokens never attend across them.
    ``use_varlen`` forces (True) or forbids (False) the variable-length flash kernel; the default
    uses it on CUDA for fp16/bf16 without dropout when this torch has it, and plain SDPA when the
    pack holds a single sequence.
    """
    import torch

    if use_varlen is None and cu_seqlens.numel() == 2 and max_seqlen == query.shape[0]:
        # one sequence: plain causal SDPA (torch picks cuDNN/flash), no host sync
        return sdpa_bshd(query[:, None], key[:, None], value[:, None], scale=scale,
                         dropout_p=dropout_p)[:, 0]
    kwargs = _varlen_kwargs()
    if use_varlen is None:
        use_varlen = (query.is_cuda and dropout_p == 0.0 and kwargs is not None
                      and query.dtype in (torch.float16, torch.bfloat16))
    if use_varlen:
        if kwargs is None:
            raise RuntimeError("this torch has no torch.nn.attention.varlen.varlen_attn")
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        out = _varlen(query, key, value, cu_seqlens.to(torch.int32), int(max_seqlen), scale, kwargs)
        return out.reshape(query.shape[0], -1)
    bounds = cu_seqlens.tolist()  # a host tensor here costs no device sync
    outs = []
    for start, end in itertools.pairwise(bounds):
        if end == start:
            continue
        # 4-D [s, 1, h, d] views: the fused kernels need a batch dimension (3-D inputs fall back
        # to the math kernel and its [h, s, s] scores)
        q, k, v = (t[start:end, None] for t in (query, key, value))
        outs.append(sdpa_bshd(q, k, v, scale=scale, dropout_p=dropout_p)[:, 0])
    if bounds[-1] < query.shape[0]:  # tokens after the last sequence attend to nothing
        width = query.shape[1] * value.shape[-1]
        outs.append(query.new_zeros(query.shape[0] - bounds[-1], width))
    return torch.cat(outs, dim=0)

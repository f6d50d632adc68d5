"""Per-token logprobs and entropy from (vocab-parallel) logits, in float32, with autograd.

With tensor parallelism each rank holds a slice ``[vocab_start, vocab_start + V_local)`` of the
logits; the log-partition function and the target logit are combined across the TP group with
autograd-aware all-reduces, so no rank ever materialises the full vocabulary. Columns past the
real vocabulary (Megatron's padding) are dropped, so the result equals the HF model's
``log_softmax`` exactly up to float rounding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) in forward, identity in backward.

    Every TP rank then computes the same loss from the reduced value, and each rank's gradient
    of its own copy is already the gradient of its slice (megatron's
    ``reduce_from_tensor_model_parallel_region``); summing gradients too would count them once
    per rank.
    """

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def _all_reduce(t: torch.Tensor, group: Any) -> torch.Tensor:
    return _SumOverRanks.apply(t, group)


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_size: int | None = None,
    vocab_start: int = 0,
    tp_group: Any = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log p(labels)`` and optionally the entropy, both float32 with shape ``labels.shape``.

    ``logits[..., v]`` is the logit of token ``vocab_start + v``; ``vocab_size`` is the real
    vocabulary (columns at or past it are ignored); ``tp_group`` is the tensor-parallel group
    whose ranks hold the other slices (None: this tensor is the whole vocabulary).
    """
    local = logits.shape[-1]
    if vocab_size is not None:
        valid = max(0, min(local, vocab_size - vocab_start))
        if valid == 0:
            raise ValueError(
                f"logit slice [{vocab_start}, {vocab_start + local}) holds no real token of a "
                f"{vocab_size}-token vocabulary; pad the vocabulary less"
            )
        logits = logits[..., :valid]
        local = valid
    x = logits.float()
    distributed = tp_group is not None and dist.get_world_size(tp_group) > 1
    with torch.no_grad():
        maxes = x.max(dim=-1).values
        if distributed:
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = x - maxes.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = exp.sum(dim=-1)
    in_slice = (labels >= vocab_start) & (labels < vocab_start + local)
    index = (labels - vocab_start).clamp(0, local - 1).unsqueeze(-1)
    target = torch.where(in_slice, shifted.gather(-1, index).squeeze(-1), 0.0)
    weighted = (exp * shifted).sum(dim=-1) if with_entropy else None
    if distributed:
        sum_exp = _all_reduce(sum_exp, tp_group)
        target = _all_reduce(target, tp_group)
        if weighted is not None:
            weighted = _all_reduce(weighted, tp_group)
    log_z = sum_exp.log()
    logprobs = target - log_z
    entropy = None if weighted is None else log_z - weighted / sum_exp
    return logprobs, entropy


def shifted_token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    vocab_size: int | None = None,
    vocab_start: int = 0,
    tp_group: Any = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs aligned with the tokens: ``out[..., t] = log p(token_t | tokens_<t)``.

    ``logits`` is ``[R, L, V_local]`` for ``input_ids`` ``[R, L]``; position 0 (no context)
    gets 0, as does the entropy there. In a packed row the first token of each later sequence
    gets a meaningless value that the loss mask (0 on every first token) removes.
    """
    lp, ent = vocab_parallel_logprobs(
        logits[:, :-1], input_ids[:, 1:], vocab_size=vocab_size, vocab_start=vocab_start,
        tp_group=tp_group, with_entropy=with_entropy,
    )
    zero = lp.new_zeros(lp.shape[0], 1)
    logprobs = torch.cat([zero, lp], dim=1)
    entropy = None if ent is None else torch.cat([zero, ent], dim=1)
    return logprobs, entropy

"""Per-token logprobs and entropy from (vocab-parallel) logits, in float32, with autograd.

With tensor parallelism each rank holds a slice ``[vocab_start, vocab_start + V_local)`` of the
logits; the log-partition function, the target logit and the entropy are combined across the TP
group with two all-reduces, so no rank ever materialises the full vocabulary. The float32 work
runs in chunks of rows inside one autograd Function whose backward recomputes the chunk's
softmax (no float32 ``[tokens, vocab]`` copy, shifted logits or exponentials are kept for it).
Columns past the real vocabulary (Megatron's padding) are dropped, so the result equals the HF
model's ``log_softmax`` exactly up to float rounding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

#: rows per chunk of the float32 work (4096 rows x a 152k vocabulary slice: 2.5 GB at a time)
CHUNK_ROWS = 4096


def _chunk_stats(z: torch.Tensor, idx: torch.Tensor, in_slice: torch.Tensor
                 ) -> tuple[torch.Tensor, ...]:
    """Per row of a float32 chunk: max, sum exp(z - max), sum exp(z - max)(z - max), target."""
    m = z.max(dim=-1).values
    shifted = z - m[:, None]
    e = shifted.exp()
    target = torch.where(in_slice, z.gather(-1, idx[:, None]).squeeze(-1), 0.0)
    return m, e.sum(-1), (e * shifted).sum(-1), target


class _VocabParallelLogprobs(torch.autograd.Function):
    """``(logits [N, V_local], labels [N]) -> (logp [N], entropy [N])`` over the TP group.

    Forward: per chunk of rows, float32 statistics of this rank's slice; one MAX and one SUM
    all-reduce combine them into the global log-partition ``lse`` and entropy. Only the input
    logits (alive anyway as the model's output), ``lse`` and the entropy are kept: the backward
    recomputes each chunk's probabilities ``p = exp(z - lse)`` and needs no communication,
    since ``d logp / dz = onehot - p`` and ``d H / dz = -p (z - E_p[z])`` are local given the
    global ``lse`` and ``H``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, local: int,
        group: Any, chunk: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = logits.shape[0]  # columns at or past ``local`` are vocabulary padding
        in_slice = (labels >= vocab_start) & (labels < vocab_start + local)
        idx = (labels - vocab_start).clamp(0, local - 1)
        stats = [torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(4)]
        for s in range(0, n, chunk):
            z = logits[s:s + chunk, :local].float()
            for out, value in zip(stats, _chunk_stats(z, idx[s:s + chunk], in_slice[s:s + chunk])):
                out[s:s + chunk] = value
        m, sum_exp, weighted, target = stats
        if group is not None:
            global_m = m.clone()
            dist.all_reduce(global_m, op=dist.ReduceOp.MAX, group=group)
            scale = torch.exp(m - global_m)  # this rank's sums, re-based on the global max
            packed = torch.stack([sum_exp * scale,
                                  scale * (weighted + sum_exp * (m - global_m)), target])
            dist.all_reduce(packed, group=group)
            sum_exp, weighted, target = packed.unbind(0)
            m = global_m
        log_s = sum_exp.log()
        lse = m + log_s
        logp = target - lse
        entropy = log_s - weighted / sum_exp
        ctx.save_for_backward(logits, idx, in_slice, lse, entropy)
        ctx.chunk, ctx.local = chunk, local
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logp: torch.Tensor | None, grad_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, None, None, None, None]:
        logits, idx, in_slice, lse, entropy = ctx.saved_tensors
        local = ctx.local
        grad = torch.zeros_like(logits) if local < logits.shape[1] else torch.empty_like(logits)
        n, chunk = logits.shape[0], ctx.chunk
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = logits[s:e, :local].float()
            p = torch.exp(z - lse[s:e, None])
            g = torch.zeros_like(z)
            if grad_logp is not None:
                gl = grad_logp[s:e].float()
                g -= p * gl[:, None]
                g.scatter_add_(-1, idx[s:e, None], (gl * in_slice[s:e])[:, None])
            if grad_ent is not None:
                mean_z = lse[s:e] - entropy[s:e]
                g -= p * (z - mean_z[:, None]) * grad_ent[s:e].float()[:, None]
            grad[s:e, :local] = g.to(grad.dtype)
        return grad, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_size: int | None = None,
    vocab_start: int = 0,
    tp_group: Any = None,
    with_entropy: bool = False,
    chunk_rows: int = CHUNK_ROWS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log p(labels)`` and optionally the entropy, both float32 with shape ``labels.shape``.

    ``logits[..., v]`` is the logit of token ``vocab_start + v``; ``vocab_size`` is the real
    vocabulary (columns at or past it are ignored); ``tp_group`` is the tensor-parallel group
    whose ranks hold the other slices (None: this tensor is the whole vocabulary). The float32
    work runs in chunks of ``chunk_rows`` rows and is recomputed in the backward, so no
    ``[tokens, vocab]`` float32 copy is kept for it.
    """
    local = logits.shape[-1]
    if vocab_size is not None:
        valid = max(0, min(local, vocab_size - vocab_start))
        if valid == 0:
            raise ValueError(
                f"logit slice [{vocab_start}, {vocab_start + local}) holds no real token of a "
                f"{vocab_size}-token vocabulary; pad the vocabulary less"
            )
        local = valid
    distributed = tp_group is not None and dist.get_world_size(tp_group) > 1
    shape = labels.shape
    logp, entropy = _VocabParallelLogprobs.apply(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), vocab_start, local,
        tp_group if distributed else None, chunk_rows)
    return logp.reshape(shape), (entropy.reshape(shape) if with_entropy else None)


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

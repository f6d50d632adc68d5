"""Token logprobs and entropies straight from hidden states, without a ``[T, V]`` logit matrix.

The plain path (`palaestra.trainers.torch_backend.logprobs`) takes the model's logits ``[R, L, V]``
(bf16 under autocast), makes a float32 copy and keeps both alive for the backward: at the
Qwen3 vocabulary (151,936) a packed micro-batch of 16k tokens holds ~15 GB of logits and
softmax. Here the ``lm_head`` matmul runs per chunk of tokens inside one autograd Function:

- forward: per chunk ``z = (h_c @ W^T) / T`` in float32, then ``logsumexp``, the target's logit
  and (optionally) the entropy; only ``[N]``-sized results are kept.
- backward: each chunk's logits are recomputed and turned into ``dL/dz`` directly
  (``d logp/dz = onehot - p``, ``d H/dz = -p (z - E_p[z])``), then projected to ``dL/dh`` and
  accumulated into ``dL/dW`` (float32), in place, so two chunks of float32 logits are alive.

The matmul runs in the autocast dtype when autocast is on (as the model's ``lm_head`` would),
everything after it in float32, so the values equal the plain path's up to float rounding.
"""

from __future__ import annotations

from typing import Any

import torch

#: tokens per chunk: 4096 x 151,936 x 4 bytes = 2.5 GB of float32 logits at a time
DEFAULT_CHUNK_TOKENS = 4096


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(t.device.type):
        return torch.get_autocast_dtype(t.device.type)
    return t.dtype


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                  inv_temp: float) -> torch.Tensor:
    z = h @ w.t()
    z = z.to(torch.promote_types(z.dtype, torch.float32))  # float64 stays (gradcheck)
    if bias is not None:
        z = z + bias.to(z.dtype)
    return z * inv_temp if inv_temp != 1.0 else z


def _forward_chunks(
    h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
    inv_temp: float, with_entropy: bool, chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(logp, lse, entropy) of every row; ``h`` and ``w`` already in the matmul dtype."""
    n = h.shape[0]
    logp = torch.empty(n, dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if with_entropy else None
    for s in range(0, n, chunk):
        z = _chunk_logits(h[s:s + chunk], w, bias, inv_temp)
        lse_c = torch.logsumexp(z, dim=-1)
        lse[s:s + chunk] = lse_c
        logp[s:s + chunk] = z.gather(-1, targets[s:s + chunk, None]).squeeze(-1) - lse_c
        if entropy is not None:
            neg_logp = lse_c[:, None] - z
            # sum p (lse - z): no cancellation of two large terms (lse - E_p[z] loses ~1e-5)
            entropy[s:s + chunk] = (torch.exp(-neg_logp) * neg_logp).sum(-1)
    return logp, lse, entropy


class _LinearLogprobs(torch.autograd.Function):
    """``(hidden [N, H], weight [V, H], bias, targets [N]) -> (logp [N], entropy [N] | empty)``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
        targets: torch.Tensor, inv_temp: float, with_entropy: bool, chunk: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = _compute_dtype(hidden)
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            logp, lse, entropy = _forward_chunks(h, w, bias, targets, inv_temp, with_entropy,
                                                 chunk)
        ent = entropy if entropy is not None else logp.new_empty(0)
        ctx.save_for_backward(h, w, bias, targets, lse, ent)
        ctx.meta = (inv_temp, chunk, hidden.dtype, weight.dtype)
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logp: torch.Tensor | None, grad_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        h, w, bias, targets, lse, ent = ctx.saved_tensors
        inv_temp, chunk, hidden_dtype, weight_dtype = ctx.meta
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if grad_ent is not None and ent.numel() == 0:
            grad_ent = None
        grad_h = torch.empty_like(h) if need_h else None
        acc = torch.promote_types(w.dtype, torch.float32)
        grad_w = torch.zeros(w.shape, dtype=acc, device=w.device) if need_w else None
        grad_b = torch.zeros(w.shape[0], dtype=acc, device=w.device) \
            if need_b and bias is not None else None
        n = h.shape[0]
        rows = torch.arange(min(chunk, n), device=h.device)
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                z = _chunk_logits(h[s:e], w, bias, inv_temp)
                # dL/dz = gl (onehot - p) - ge p (z - E_p[z]) = -p (gl + ge (z - E_p[z])) + gl
                # onehot, built in place in z and p: two float32 chunks alive, not six
                p = torch.sub(z, lse[s:e, None]).exp_()
                if grad_ent is not None:  # E_p[z] = lse - H
                    coeff = z.sub_((lse[s:e] - ent[s:e])[:, None])
                    coeff.mul_(grad_ent[s:e].to(z.dtype)[:, None])
                    if grad_logp is not None:
                        coeff.add_(grad_logp[s:e].to(z.dtype)[:, None])
                    g = p.mul_(coeff).neg_()
                elif grad_logp is not None:
                    g = p.mul_(grad_logp[s:e].to(z.dtype).neg()[:, None])
                else:
                    g = p.zero_()
                del z
                if grad_logp is not None:
                    g[rows[: e - s], targets[s:e]] += grad_logp[s:e].to(g.dtype)
                if inv_temp != 1.0:
                    g.mul_(inv_temp)
                if grad_b is not None:
                    grad_b += g.sum(0)
                g = g.to(w.dtype)
                if grad_h is not None:
                    grad_h[s:e] = g @ w
                if grad_w is not None:
                    grad_w += (g.t() @ h[s:e]).to(acc)
        return (
            None if grad_h is None else grad_h.to(hidden_dtype),
            None if grad_w is None else grad_w.to(weight_dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None, None, None, None,
        )


def linear_token_logprobs(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    *,
    bias_V: torch.Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax((h W^T + b) / T)[target]`` (and the entropy) per row, float32 ``[N]``.

    Equals `palaestra.trainers.torch_backend.logprobs.token_logprobs` of the materialised
    logits, with gradients to ``hidden``, ``weight`` and ``bias``; the entropy is differentiable
    too (detach it when it is only a metric, and its backward costs nothing).
    """
    if chunk_tokens < 1:
        raise ValueError("chunk_tokens must be >= 1")
    targets_N = targets_N.long()
    inv_temp = 1.0 / temperature
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden_NH, weight_VH, bias_V))
    if not needs_grad:
        dtype = _compute_dtype(hidden_NH)
        with torch.no_grad(), torch.autocast(hidden_NH.device.type, enabled=False):
            logp, _, entropy = _forward_chunks(
                hidden_NH.to(dtype), weight_VH.to(dtype), bias_V, targets_N, inv_temp,
                with_entropy, chunk_tokens)
        return logp, entropy
    logp, ent = _LinearLogprobs.apply(hidden_NH, weight_VH, bias_V, targets_N, inv_temp,
                                      with_entropy, chunk_tokens)
    return logp, (ent if with_entropy else None)


def shifted_linear_logprobs(
    hidden_RLH: torch.Tensor,
    weight_VH: torch.Tensor,
    input_ids_RL: torch.Tensor,
    valid_RL: torch.Tensor,
    *,
    bias_V: torch.Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`shifted_token_logprobs` from the last hidden states: ``[R, L]``, 0 where not valid.

    Only the valid positions are computed (padding and each sequence's first token cost
    nothing).
    """
    mask = valid_RL[:, 1:]
    logp_N, ent_N = linear_token_logprobs(
        hidden_RLH[:, :-1][mask], weight_VH, input_ids_RL[:, 1:][mask], bias_V=bias_V,
        temperature=temperature, with_entropy=with_entropy, chunk_tokens=chunk_tokens,
    )

    def place(values_N: torch.Tensor) -> torch.Tensor:
        full = values_N.new_zeros(mask.shape).masked_scatter(mask, values_N)
        return torch.cat([full.new_zeros(full.shape[0], 1), full], dim=1)

    return place(logp_N), (None if ent_N is None else place(ent_N))


__all__ = ["DEFAULT_CHUNK_TOKENS", "linear_token_logprobs", "shifted_linear_logprobs"]

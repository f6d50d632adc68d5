"""Policy-gradient losses per token: PPO clip (clip-higher, dual clip), GSPO, TIS weights.

All functions return per-token losses (to be aggregated with ``aggregation.loss_token_weights``)
and per-token statistics (clip fractions, ratios) aggregated the same way for logging.
``logp`` carries the gradient; ``old_logp`` (behaviour policy of the update) and the advantages
are constants.

PPO (Schulman et al. 2017) with clip-higher (DAPO, Yu et al. 2025) and dual clip (Ye et al.
2020), with ``rho_t = exp(logp_t - old_logp_t)``::

    L_t = max(-A_t rho_t, -A_t clip(rho_t, 1 - eps_low, 1 + eps_high))
    if A_t < 0 and dual clip c:  L_t = min(L_t, -c A_t)

GSPO (Zheng et al. 2025), sequence ratio ``s_i = exp(mean_{t in y_i}(logp_t - old_logp_t))``,
token form ``s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]`` (same value as ``s_i``, gradient
``s_i * grad logp_t``)::

    L_{i,t} = max(-A_{i,t} s_{i,t}, -A_{i,t} clip(s_{i,t}, 1 - eps_low, 1 + eps_high))

With ``seq-mean-token-mean`` aggregation and one advantage per sequence this is exactly GSPO's
sequence objective; other aggregations give GSPO-token variants.

Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training"): the engine's sampling logprobs differ from the trainer's, so the
token loss is weighted by ``min(exp(old_logp - rollout_logp), C)`` (a constant).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from palaestra.trainers.algorithms.kl import LOG_RATIO_CLAMP


class TokenLoss(NamedTuple):
    """Per-token loss and per-token statistics (same shape as the inputs)."""

    loss: torch.Tensor
    stats: dict[str, torch.Tensor]


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None,
) -> TokenLoss:
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    stats = {
        "clip_frac": (clipped > unclipped).to(ratio.dtype).detach(),
        "clip_frac_low": ((ratio < 1.0 - eps_low) & (advantages < 0)).to(ratio.dtype).detach(),
        "clip_frac_high": ((ratio > 1.0 + eps_high) & (advantages > 0)).to(ratio.dtype).detach(),
        "ratio": ratio.detach(),
    }
    if dual_clip_c is not None:
        bound = -advantages * dual_clip_c
        dual = (advantages < 0) & (bound < loss)
        loss = torch.where(dual, bound, loss)
        stats["dual_clip_frac"] = dual.to(ratio.dtype).detach()
    return TokenLoss(loss, stats)


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip_c: float | None = None,
) -> TokenLoss:
    """PPO's clipped surrogate per token, with separate low/high clip and optional dual clip."""
    log_ratio = (logp - old_logp.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return _clipped_surrogate(
        torch.exp(log_ratio), advantages.detach(), eps_low, eps_high, dual_clip_c
    )


def sequence_mean(
    values: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor | None = None
) -> torch.Tensor:
    """Masked mean of ``values`` over each sequence, broadcast back to its tokens.

    Without ``seq_index`` every row of a 2-D input is one sequence; with it (same shape, -1 =
    no sequence) several sequences can share a row (packed micro-batches).
    """
    m = mask.to(values.dtype)
    if seq_index is None:
        means = (values * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
        return means.expand_as(values)
    flat_idx = seq_index.reshape(-1)
    valid = flat_idx >= 0
    idx = torch.where(valid, flat_idx, 0)
    num = int(flat_idx.max().item()) + 1 if valid.any() else 1
    weighted = torch.where(valid, (values * m).reshape(-1), 0.0)
    counts_src = torch.where(valid, m.reshape(-1), 0.0)
    zeros = torch.zeros(num, dtype=values.dtype, device=values.device)
    sums = zeros.index_add(0, idx, weighted)
    counts = zeros.index_add(0, idx, counts_src)
    means = sums / counts.clamp(min=1)
    return torch.where(valid, means[idx], 0.0).reshape(values.shape)


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    seq_index: torch.Tensor | None = None,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> TokenLoss:
    """GSPO's clipped objective with the length-normalised sequence ratio (token form)."""
    log_ratio = logp - old_logp.detach()
    seq_log_ratio = sequence_mean(log_ratio.detach(), mask, seq_index)
    token_log_ratio = seq_log_ratio + logp - logp.detach()
    ratio = torch.exp(token_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return _clipped_surrogate(ratio, advantages.detach(), eps_low, eps_high, None)


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights ``min(pi_old / pi_rollout, cap)`` (no gradient)."""
    log_ratio = (old_logp.detach() - rollout_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_ratio).clamp(max=cap).detach()


__all__ = ["TokenLoss", "gspo_loss", "ppo_clip_loss", "sequence_mean", "tis_weights"]

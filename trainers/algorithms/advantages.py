"""Advantage estimators: pure functions over reward and value tensors.

Shapes: ``_N`` per sequence (sample), ``_BT`` per token of right-padded sequences (row = sample),
``_T`` per token of one sequence. ``mask_BT`` is the loss mask (1 = token sampled by the policy);
tokens with mask 0 (prompt, tool output, padding) get advantage 0 and are skipped by the
recursions, so a multi-turn sample is treated as the chain of its sampled tokens.

Formulas (``g`` = the group of sample ``i``, i.e. the samples drawn for the same prompt):

- GRPO (Shao et al. 2024):            ``A_i = (r_i - mean_g r) / (std_g r + eps)``
- Dr. GRPO (Liu et al. 2025):         ``A_i = r_i - mean_g r`` (no std; pair it with
  ``seq-mean-token-sum-norm`` aggregation)
- RLOO (Ahmadian et al. 2024):        ``A_i = r_i - 1/(n_g - 1) sum_{j in g, j != i} r_j``
- REINFORCE++ (Hu 2025):              ``A_t = whiten(G_t)``, ``G_t = sum_{s >= t} gamma^(s-t) r_s``
  with the outcome reward on the last sampled token and optional per-token KL penalties
- REINFORCE++-baseline:               as REINFORCE++ with ``r_i - mean_g r`` as outcome reward
- GAE (Schulman et al. 2016):         ``delta_t = r_t + gamma V_{t+1} - V_t``,
  ``A_t = delta_t + gamma lambda A_{t+1}``, returns ``R_t = A_t + V_t``
- Per-turn returns:                   ``G_k = sum_{j >= k} gamma^(j-k) r_j`` over turns ``k``,
  every token of turn ``k`` gets ``G_k``

The std is the unbiased (Bessel-corrected) one, as in the GRPO reference implementations.
A group of one sample has advantage 0 for the group estimators.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from palaestra.errors import TrajectoryValidationError


def group_index_from_ids(group_ids: Sequence[str]) -> torch.Tensor:
    """Map group id strings to ``0..G-1`` in order of first appearance (``long [N]``)."""
    index: dict[str, int] = {}
    return torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long)


def _group_sums(values_N: torch.Tensor, group_index_N: torch.Tensor) -> torch.Tensor:
    num_groups = int(group_index_N.max().item()) + 1 if group_index_N.numel() else 0
    out = torch.zeros(num_groups, dtype=values_N.dtype, device=values_N.device)
    return out.index_add_(0, group_index_N, values_N)


def group_mean_std(
    rewards_N: torch.Tensor, group_index_N: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, unbiased group std (0 for groups of one) and group size."""
    r = rewards_N.to(torch.float64)
    count_G = _group_sums(torch.ones_like(r), group_index_N)
    mean_G = _group_sums(r, group_index_N) / count_G.clamp(min=1)
    sq_G = _group_sums((r - mean_G[group_index_N]) ** 2, group_index_N)
    std_G = torch.where(count_G > 1, (sq_G / (count_G - 1).clamp(min=1)).sqrt(), 0.0)
    dtype = rewards_N.dtype
    return (
        mean_G[group_index_N].to(dtype),
        std_G[group_index_N].to(dtype),
        count_G[group_index_N].to(dtype),
    )


def grpo_advantages(
    rewards_N: torch.Tensor,
    group_index_N: torch.Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO: ``(r_i - mean_g) / (std_g + eps)``; without ``norm_by_std`` only centred."""
    mean, std, _ = group_mean_std(rewards_N, group_index_N)
    adv = rewards_N - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return adv


def dr_grpo_advantages(rewards_N: torch.Tensor, group_index_N: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: the group-centred reward ``r_i - mean_g`` (no std normalisation)."""
    return grpo_advantages(rewards_N, group_index_N, norm_by_std=False)


def rloo_advantages(rewards_N: torch.Tensor, group_index_N: torch.Tensor) -> torch.Tensor:
    """RLOO: ``r_i`` minus the mean reward of the *other* samples of its group (0 if alone)."""
    r = rewards_N.to(torch.float64)
    count = _group_sums(torch.ones_like(r), group_index_N)[group_index_N]
    total = _group_sums(r, group_index_N)[group_index_N]
    baseline = (total - r) / (count - 1).clamp(min=1)
    adv = torch.where(count > 1, r - baseline, 0.0)
    return adv.to(rewards_N.dtype)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` over the masked entries (unbiased std); 0 where mask is 0."""
    m = mask.to(values.dtype)
    n = m.sum()
    mean = (values * m).sum() / n.clamp(min=1)
    var = (((values - mean) ** 2) * m).sum() / (n - 1).clamp(min=1)
    out = (values - mean) if shift_mean else values
    return out / (var.sqrt() + eps) * m


def last_token_index(mask_BT: torch.Tensor) -> torch.Tensor:
    """Index of the last masked token of each row (-1 for rows without one)."""
    T = mask_BT.shape[-1]
    positions = torch.arange(T, device=mask_BT.device).expand_as(mask_BT)
    return torch.where(mask_BT.bool(), positions, -1).max(dim=-1).values


def outcome_token_rewards(rewards_N: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Token rewards with each sample's outcome reward on its last sampled token, 0 elsewhere."""
    out = torch.zeros(mask_BT.shape, dtype=rewards_N.dtype, device=rewards_N.device)
    last = last_token_index(mask_BT)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = rewards_N[rows]
    return out


def discounted_returns(
    token_rewards_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """Return-to-go over the sampled tokens: ``G_t = r_t + gamma G_next`` (0 where mask is 0).

    ``G_next`` is the return of the next *sampled* token, so tool-output tokens between two
    assistant turns neither discount nor break the chain.
    """
    m = mask_BT.to(token_rewards_BT.dtype)
    returns = torch.zeros_like(token_rewards_BT)
    running = torch.zeros_like(token_rewards_BT[:, 0])
    for t in reversed(range(token_rewards_BT.shape[-1])):
        candidate = token_rewards_BT[:, t] + gamma * running
        running = torch.where(m[:, t] > 0, candidate, running)
        returns[:, t] = running * m[:, t]
    return returns


def reinforce_pp_advantages(
    token_rewards_BT: torch.Tensor, mask_BT: torch.Tensor, *, gamma: float = 1.0
) -> torch.Tensor:
    """REINFORCE++: discounted token returns, whitened over all sampled tokens of the batch.

    Build ``token_rewards_BT`` with ``outcome_token_rewards`` (plus ``kl.kl_penalty_rewards``
    for the KL-in-reward form of the paper).
    """
    return masked_whiten(discounted_returns(token_rewards_BT, mask_BT, gamma), mask_BT)


def reinforce_pp_baseline_advantages(
    rewards_N: torch.Tensor,
    group_index_N: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    token_penalty_BT: torch.Tensor | None = None,
    gamma: float = 1.0,
) -> torch.Tensor:
    """REINFORCE++-baseline: group-centred outcome reward, returns, then batch whitening.

    ``token_penalty_BT`` is added to the token rewards (e.g. ``-beta * KL_t``).
    """
    centred = rewards_N - group_mean_std(rewards_N, group_index_N)[0]
    token_rewards = outcome_token_rewards(centred, mask_BT)
    if token_penalty_BT is not None:
        token_rewards = token_rewards + token_penalty_BT * mask_BT.to(token_rewards.dtype)
    return reinforce_pp_advantages(token_rewards, mask_BT, gamma=gamma)


def gae_advantages(
    token_rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the sampled tokens; returns ``(advantages_BT, returns_BT)`` (0 where mask 0).

    ``values_BT[t]`` is the critic's estimate before token ``t`` was sampled. The value after
    the last sampled token is 0 (the episode ended). Advantages are not whitened here.
    """
    m = mask_BT.to(values_BT.dtype)
    B, T = values_BT.shape
    adv = torch.zeros_like(values_BT)
    next_value = torch.zeros(B, dtype=values_BT.dtype, device=values_BT.device)
    last_gae = torch.zeros_like(next_value)
    for t in reversed(range(T)):
        delta = token_rewards_BT[:, t] + gamma * next_value - values_BT[:, t]
        gae = delta + gamma * lam * last_gae
        keep = m[:, t] > 0
        last_gae = torch.where(keep, gae, last_gae)
        next_value = torch.where(keep, values_BT[:, t], next_value)
        adv[:, t] = last_gae * m[:, t]
    returns = (adv + values_BT) * m
    return adv, returns


def turn_returns(turn_rewards: Sequence[float], gamma: float = 1.0) -> list[float]:
    """Discounted return from each turn: ``G_k = r_k + gamma G_{k+1}``."""
    out: list[float] = []
    running = 0.0
    for r in reversed(turn_rewards):
        running = float(r) + gamma * running
        out.append(running)
    return out[::-1]


def turn_spans(turn_ends: Sequence[int], num_tokens: int) -> list[tuple[int, int]]:
    """Token ranges ``[start, end)`` of each turn: turn ``k`` ends at ``turn_ends[k]``."""
    spans = []
    start = 0
    for end in turn_ends:
        end = min(int(end), num_tokens)
        spans.append((start, end))
        start = end
    return spans


def turn_returns_to_tokens(
    turn_rewards: Sequence[float],
    turn_ends: Sequence[int],
    mask_T: torch.Tensor,
    *,
    gamma: float = 1.0,
) -> torch.Tensor:
    """Per-token signal from per-turn rewards: each sampled token of turn ``k`` gets ``G_k``."""
    if len(turn_rewards) != len(turn_ends):
        raise TrajectoryValidationError(
            f"{len(turn_rewards)} turn rewards but {len(turn_ends)} turn ends; the rollout must "
            "record one turn end per rewarded assistant turn"
        )
    out = torch.zeros(mask_T.shape, dtype=torch.float32)
    spans = turn_spans(turn_ends, mask_T.shape[0])
    for (start, end), g in zip(spans, turn_returns(turn_rewards, gamma)):
        out[start:end] = g
    return out * mask_T.to(out.dtype)


def turn_token_rewards(
    turn_rewards: Sequence[float], turn_ends: Sequence[int], mask_T: torch.Tensor
) -> torch.Tensor:
    """Token rewards with each turn's reward on its last sampled token (GAE, REINFORCE++)."""
    out = torch.zeros(mask_T.shape, dtype=torch.float32)
    sampled = mask_T.bool()
    for (start, end), r in zip(turn_spans(turn_ends, mask_T.shape[0]), turn_rewards):
        idx = torch.nonzero(sampled[start:end]).squeeze(-1)
        if idx.numel():
            out[start + int(idx[-1])] += float(r)
    return out


__all__ = [
    "discounted_returns",
    "dr_grpo_advantages",
    "gae_advantages",
    "group_index_from_ids",
    "group_mean_std",
    "grpo_advantages",
    "last_token_index",
    "masked_whiten",
    "outcome_token_rewards",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "turn_returns",
    "turn_returns_to_tokens",
    "turn_spans",
    "turn_token_rewards",
]

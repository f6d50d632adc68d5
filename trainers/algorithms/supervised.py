"""Offline objectives: SFT (masked negative log-likelihood) and DPO.

SFT: ``L = -sum_t w_t log pi(y_t | y_<t)`` with ``w`` from the loss aggregation over the loss
mask (assistant tokens; prompt and tool-output tokens have mask 0).

DPO (Rafailov et al. 2023), with sequence logprob sums over the response tokens of the chosen
``c`` and rejected ``r`` completion and the frozen reference policy::

    h = beta * ((log pi(c) - log pi_ref(c)) - (log pi(r) - log pi_ref(r)))
    L = -(1 - eps) log sigmoid(h) - eps log sigmoid(-h)

``eps`` is the label smoothing of conservative DPO (Mitchell 2023); ``eps = 0`` is plain DPO.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from palaestra.trainers.algorithms.aggregation import aggregate_loss
from palaestra.trainers.algorithms.policy_loss import TokenLoss


def sft_loss(
    logp_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str = "token-mean"
) -> torch.Tensor:
    """Masked NLL of the sampled/demonstrated tokens, aggregated with ``mode``."""
    return aggregate_loss(-logp_BT, mask_BT, mode)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> TokenLoss:
    """Per-pair DPO loss from sequence logprob sums (``[P]`` each) and per-pair statistics."""
    chosen_reward = beta * (policy_chosen - ref_chosen.detach())
    rejected_reward = beta * (policy_rejected - ref_rejected.detach())
    h = chosen_reward - rejected_reward
    loss = -(1.0 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
    stats = {
        "dpo_reward_chosen": chosen_reward.detach(),
        "dpo_reward_rejected": rejected_reward.detach(),
        "dpo_reward_margin": h.detach(),
        "dpo_reward_accuracy": (h > 0).to(h.dtype).detach(),
    }
    return TokenLoss(loss, stats)


__all__ = ["dpo_loss", "sft_loss"]

"""PPO's clipped value loss for the critic.

With ``V`` the new values, ``V_old`` the values when the batch was collected and ``R`` the GAE
returns (Schulman et al. 2017; the clipped form as in OpenAI baselines)::

    V_clip = V_old + clip(V - V_old, -eps, eps)
    L_t    = 1/2 max((V - R)^2, (V_clip - R)^2)

Without a clip range it is ``1/2 (V - R)^2``.
"""

from __future__ import annotations

import torch

from palaestra.trainers.algorithms.policy_loss import TokenLoss


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    *,
    clip: float | None = 0.2,
) -> TokenLoss:
    """Per-token (clipped) squared error of the critic; stat ``value_clip_frac``."""
    returns = returns.detach()
    unclipped = (values - returns) ** 2
    if clip is None:
        return TokenLoss(0.5 * unclipped, {"value_clip_frac": torch.zeros_like(unclipped)})
    old = old_values.detach()
    clipped_values = old + (values - old).clamp(-clip, clip)
    clipped = (clipped_values - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped, clipped)
    return TokenLoss(loss, {"value_clip_frac": (clipped > unclipped).to(values.dtype).detach()})


__all__ = ["clipped_value_loss"]

"""KL divergence to a reference policy, estimated per token from sampled tokens.

With ``log_ratio = logp - ref_logp`` of the sampled token (Schulman, "Approximating KL
divergence", 2020):

- ``k1 = log_ratio``                              unbiased, high variance, can be negative
- ``k2 = log_ratio**2 / 2``                       biased, low variance, >= 0
- ``k3 = exp(-log_ratio) + log_ratio - 1``        unbiased, low variance, >= 0 (GRPO's choice)

Used either as a loss term (``kl_coef * KL`` aggregated like the policy loss) or as a reward
penalty (``r_t -= kl_coef * KL_t``) before the advantages are computed.
"""

from __future__ import annotations

import torch

from palaestra.errors import ConfigError

#: log-ratios are clamped to this range so exp() cannot overflow on a stray token
LOG_RATIO_CLAMP = 20.0


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL estimate ``k1``, ``k2`` or ``k3`` of ``pi`` to ``pi_ref`` (same shape)."""
    log_ratio = (logp - ref_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1.0
    raise ConfigError(f"unknown KL estimator {kind!r}; choose 'k1', 'k2' or 'k3'")


def kl_penalty_rewards(
    token_rewards: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
    kind: str = "k1",
) -> torch.Tensor:
    """Token rewards minus ``kl_coef * KL_t`` on the sampled tokens (KL as a reward penalty)."""
    kl = kl_estimate(logp.detach(), ref_logp, kind)
    return token_rewards - kl_coef * kl * mask.to(kl.dtype)


__all__ = ["LOG_RATIO_CLAMP", "kl_estimate", "kl_penalty_rewards"]

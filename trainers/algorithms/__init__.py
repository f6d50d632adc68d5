"""RL, SFT and DPO algorithms as small pure functions over torch tensors.

Modules (each documents its formulas):

- ``config``: ``LossConfig`` and its presets (pydantic; imports no torch)
- ``advantages``: GRPO, Dr. GRPO, RLOO, REINFORCE++(-baseline), GAE, per-turn returns
- ``estimators``: ``compute_advantages(batch, cfg)``, the glue from rewards to token advantages
- ``tree_advantages``: per-turn credit over a branching group's prefix tree (estimator "tree")
- ``policy_loss``: PPO clip (clip-higher, dual clip), GSPO, truncated importance sampling
- ``kl``: k1/k2/k3 estimators, KL as reward penalty
- ``aggregation``: token/sequence/group loss aggregation as per-token weights
- ``value_loss``: PPO's clipped value loss
- ``supervised``: SFT (masked NLL) and DPO
- ``objective``: the loss of one micro-batch under a ``LossConfig``
- ``mismatch``: the rollout/trainer logprob mismatch (``rollout/logprob_max_abs_diff``)
- ``distill``: on-policy distillation's per-token reverse-KL advantages

Names are re-exported lazily, so ``from palaestra.trainers.algorithms import LossConfig`` does
not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names for type checkers; at run time they load on first use
    from palaestra.trainers.algorithms.advantages import (
        dr_grpo_advantages,
        gae_advantages,
        grpo_advantages,
        reinforce_pp_advantages,
        reinforce_pp_baseline_advantages,
        rloo_advantages,
    )
    from palaestra.trainers.algorithms.aggregation import aggregate_loss, loss_token_weights
    from palaestra.trainers.algorithms.config import PRESETS, LossConfig
    from palaestra.trainers.algorithms.estimators import compute_advantages
    from palaestra.trainers.algorithms.kl import kl_estimate
    from palaestra.trainers.algorithms.policy_loss import gspo_loss, ppo_clip_loss, tis_weights
    from palaestra.trainers.algorithms.supervised import dpo_loss, sft_loss
    from palaestra.trainers.algorithms.value_loss import clipped_value_loss

_EXPORTS = {
    "LossConfig": "config",
    "PRESETS": "config",
    "compute_advantages": "estimators",
    "grpo_advantages": "advantages",
    "dr_grpo_advantages": "advantages",
    "rloo_advantages": "advantages",
    "reinforce_pp_advantages": "advantages",
    "reinforce_pp_baseline_advantages": "advantages",
    "gae_advantages": "advantages",
    "ppo_clip_loss": "policy_loss",
    "gspo_loss": "policy_loss",
    "tis_weights": "policy_loss",
    "kl_estimate": "kl",
    "loss_token_weights": "aggregation",
    "aggregate_loss": "aggregation",
    "clipped_value_loss": "value_loss",
    "sft_loss": "supervised",
    "dpo_loss": "supervised",
}

__all__ = [
    "PRESETS",
    "LossConfig",
    "aggregate_loss",
    "clipped_value_loss",
    "compute_advantages",
    "dpo_loss",
    "dr_grpo_advantages",
    "gae_advantages",
    "grpo_advantages",
    "gspo_loss",
    "kl_estimate",
    "loss_token_weights",
    "ppo_clip_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "sft_loss",
    "tis_weights",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)

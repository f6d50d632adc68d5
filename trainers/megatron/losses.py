"""Adapter from the shared pure losses (`palaestra.trainers.algorithms`) to Megatron micro-batches.

The Megatron backend computes the same objective as the PyTorch backend: per-token aggregation
weights are computed once over the whole batch (so micro-batching and data parallelism give the
full-batch gradient), then each micro-batch's loss is ``objective.rl_loss``,
``sft_loss_micro``, ``dpo_loss_micro`` or (a critic) ``value_loss_micro`` on its slice. This module
is the only place that knows their signatures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from palaestra.errors import ConfigError
from palaestra.trainers.loss_inputs import LOSS_WEIGHTS as WEIGHTS

if TYPE_CHECKING:
    import torch

    from palaestra.trainers.algorithms.config import LossConfig
    from palaestra.trainers.micro_batches import MicroBatch


def needs_entropy(loss_cfg: LossConfig) -> bool:
    return loss_cfg.objective != "dpo" and loss_cfg.entropy_coef > 0.0


def critic_loss(
    loss_cfg: LossConfig, mb: MicroBatch, values: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's (clipped) value loss of one micro-batch."""
    from palaestra.trainers.algorithms.objective import value_loss_micro

    f = mb.fields
    return value_loss_micro(loss_cfg, values=values, weights=f[WEIGHTS],
                            old_values=f["old_values"], returns=f["returns"])


def micro_batch_loss(
    loss_cfg: LossConfig, mb: MicroBatch, logp: torch.Tensor, entropy: torch.Tensor | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch (already weighted for the whole batch) and its metric sums."""
    from palaestra.trainers.algorithms.objective import (
        PAIR_WEIGHT,
        dpo_loss_micro,
        rl_loss,
        sft_loss_micro,
    )

    f = mb.fields
    weights = f[WEIGHTS]
    if loss_cfg.objective == "sft":
        return sft_loss_micro(logp=logp, weights=weights, entropy=entropy)
    if loss_cfg.objective == "dpo":
        return dpo_loss_micro(
            loss_cfg, logp=logp, ref_logp=f["ref_logprobs"], loss_mask=f["loss_mask"],
            seq_index=mb.seq_index, pair_weights=mb.seq_fields[PAIR_WEIGHT][0::2],
        )
    if loss_cfg.objective != "rl":
        raise ConfigError(
            f"objective {loss_cfg.objective!r} is not implemented by the Megatron backend "
            "(rl, sft, dpo)"
        )
    return rl_loss(
        loss_cfg, logp=logp, weights=weights, loss_mask=f["loss_mask"],
        advantages=f["advantages"], old_logp=f.get("old_logprobs"),
        ref_logp=f.get("ref_logprobs"), rollout_logp=f.get("rollout_logprobs"),
        entropy=entropy, seq_index=mb.seq_index,
    )

"""What a train step feeds its loss, the same for every backend (torch, Megatron).

`runs_ref_forward` decides whether the step computes the reference logprobs itself (a KL loss
term or DPO whose reference the batch lacks; a KL in the reward is computed before the
advantages, by the learner). `loss_micro_batches` checks the batch against the objective and
cuts it into token-balanced micro-batches carrying the per-token fields the loss reads, the
per-sequence aggregation weights under `LOSS_WEIGHTS` among them. With
``skip_zero_advantage`` it leaves out the sequences without a learning signal
(`sequences_with_signal`); the weights still come from the whole batch, so the gradient is the
same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from palaestra.errors import ConfigError
from palaestra.trace_ranges import span

if TYPE_CHECKING:
    import torch

    from palaestra.trainers.algorithms.config import LossConfig
    from palaestra.trainers.batching import TrainBatch
    from palaestra.trainers.micro_batches import MicroBatch

#: the micro-batch field of the per-token aggregation weights (the batch loss is their sum)
LOSS_WEIGHTS = "loss_weights"


def runs_ref_forward(batch: TrainBatch, loss_cfg: LossConfig, *, critic: bool,
                     has_reference: bool) -> bool:
    """Whether a train step runs the reference forward itself: the loss needs reference
    logprobs (a KL loss term, or DPO) that ``batch`` lacks, and the backend holds a reference
    (a frozen copy, or the base under a LoRA adapter). Never for a critic."""
    return (not critic and has_reference and loss_cfg.needs_ref_logprobs
            and batch.ref_logprobs is None
            and (loss_cfg.objective == "dpo" or loss_cfg.kl_mode == "loss"))


def sequences_with_signal(batch: TrainBatch, subset: Sequence[int] | None = None
                          ) -> list[int] | None:
    """The sequences of ``subset`` (default: all of ``batch``) with a non-zero advantage on a
    loss token, the ones a policy-gradient step learns from (``skip_zero_advantage``).

    When none has one, the shortest sequence alone: the optimizer still steps (AdamW moves the
    weights on zero gradients too, so no step at all would be another update), on the same
    all-zero gradient the whole batch gives, for one forward and backward instead of all."""
    if batch.advantages is None:
        return None if subset is None else list(subset)
    chosen = list(range(batch.num_sequences) if subset is None else subset)
    keep = [i for i in chosen
            if bool(((batch.advantages[i] != 0) & (batch.loss_mask[i] > 0)).any())]
    if not keep and chosen:
        keep = [min(chosen, key=lambda i: batch.loss_mask[i].numel())]
    return keep


def loss_micro_batches(batch: TrainBatch, loss_cfg: LossConfig, *, critic: bool,
                       max_tokens: int, pack: bool,
                       loss_weights: Sequence[torch.Tensor] | None = None,
                       sharded: bool = False, subset: Sequence[int] | None = None,
                       ) -> list[MicroBatch]:
    """``batch`` checked against the objective and cut into micro-batches of at most
    ``max_tokens`` (``pack``: several sequences per row), each carrying the per-token fields
    the loss reads and the aggregation weights (`LOSS_WEIGHTS`). ``loss_weights``: computed
    over the whole batch, required when ``sharded`` (a data-parallel rank's share, the
    sequences of ``subset``); default: from ``batch`` itself."""
    from palaestra.trainers.algorithms.objective import (
        batch_loss_weights,
        check_train_batch,
        sequence_fields,
    )
    from palaestra.trainers.batching import TOKEN_FIELDS
    from palaestra.trainers.micro_batches import make_micro_batches

    check_train_batch(batch, loss_cfg, critic=critic)
    if loss_weights is None and sharded:
        raise ConfigError("a data-parallel shard needs the whole batch's loss_weights")
    fields: dict[str, Sequence[torch.Tensor]] = {
        LOSS_WEIGHTS: batch_loss_weights(batch, loss_cfg) if loss_weights is None
        else tuple(loss_weights),
    }
    for name in TOKEN_FIELDS:
        value = getattr(batch, name)
        if value is not None:
            fields[name] = value
    if not (loss_cfg.tis_cap is not None or loss_cfg.objective == "rl"):
        fields.pop("rollout_logprobs", None)  # only the RL loss and TIS read them
    if loss_cfg.skip_zero_advantage and not critic:
        subset = sequences_with_signal(batch, subset)
    with span("trainer_data"):
        return make_micro_batches(
            batch, max_tokens, pack=pack, fields=fields,
            seq_fields=sequence_fields(batch.num_sequences, loss_cfg, critic=critic),
            subset=subset)


__all__ = ["LOSS_WEIGHTS", "loss_micro_batches", "runs_ref_forward", "sequences_with_signal"]

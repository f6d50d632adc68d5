"""The rollout/trainer logprob mismatch: ``rollout/logprob_max_abs_diff``, its mean, and the
largest deviation of an importance ratio from 1 (``rollout/ratio_max_abs_dev``).

``|log pi_trainer(x_t) - log pi_engine(x_t)|`` over the trained tokens (``loss_mask > 0``) of a
batch, the trainer's logprobs taken with the weights that sampled it (before the step's update).
The engine's are the ``Sample.logprobs_T`` it returned while sampling (``rollout_logprobs``).
Every micro-batch's loss (`objective.rl_loss`) reports the max, sum and count of its tokens;
backends merge micro-batches and ranks with `merge_metric` (max for `MAX_METRICS`, else sum), and
`step_metrics` turns the merged numbers into the two logged ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

#: the largest |difference| (aggregated by max over micro-batches and ranks), the sum of all of
#: them and their count (summed)
LOGPROB_DIFF_MAX = "rollout/logprob_max_abs_diff"
LOGPROB_DIFF_SUM = "rollout/logprob_abs_diff_sum"
LOGPROB_DIFF_TOKENS = "rollout/logprob_diff_tokens"
LOGPROB_DIFF_MEAN = "rollout/logprob_mean_abs_diff"
#: the largest |pi_trainer / pi_engine - 1| over the trained tokens: how far the first update's
#: importance ratios against the rollout are from 1 (exactly 0.0 in bitwise on-policy mode)
RATIO_MAX_DEV = "rollout/ratio_max_abs_dev"
#: metric keys that backends aggregate by max (over micro-batches and ranks), not by sum
MAX_METRICS = frozenset({LOGPROB_DIFF_MAX, RATIO_MAX_DEV})
_RAW = (LOGPROB_DIFF_MAX, LOGPROB_DIFF_SUM, LOGPROB_DIFF_TOKENS, RATIO_MAX_DEV)


def logprob_diff_stats(logp: torch.Tensor, rollout_logp: torch.Tensor, loss_mask: torch.Tensor
                       ) -> dict[str, torch.Tensor]:
    """Max, sum and count of ``|logp - rollout_logp|`` over the tokens where ``loss_mask > 0``
    (the trained tokens); all zero for a micro-batch without one."""
    mask = loss_mask > 0
    log_ratio = logp.detach().float() - rollout_logp.float()
    diff = torch.where(mask, log_ratio.abs(), 0.0)
    ratio_dev = torch.where(mask, torch.expm1(log_ratio).abs(), 0.0)  # exact near 0
    empty = not diff.numel()
    return {LOGPROB_DIFF_MAX: diff.sum() if empty else diff.max(),
            LOGPROB_DIFF_SUM: diff.sum(), LOGPROB_DIFF_TOKENS: mask.sum().to(diff.dtype),
            RATIO_MAX_DEV: ratio_dev.sum() if empty else ratio_dev.max()}


def merge_metric(key: str, total: float, value: float) -> float:
    """``total`` merged with one more micro-batch's ``value`` of metric ``key``: max or sum."""
    return max(total, value) if key in MAX_METRICS else total + value


def step_metrics(train: Mapping[str, float]) -> dict[str, float]:
    """``rollout/logprob_max_abs_diff`` and ``rollout/logprob_mean_abs_diff`` from a train
    step's merged metrics (empty when the step did not measure them)."""
    if LOGPROB_DIFF_TOKENS not in train:
        return {}
    tokens = train[LOGPROB_DIFF_TOKENS]
    out = {LOGPROB_DIFF_MAX: train[LOGPROB_DIFF_MAX],
           LOGPROB_DIFF_MEAN: train[LOGPROB_DIFF_SUM] / tokens if tokens else 0.0}
    if RATIO_MAX_DEV in train:
        out[RATIO_MAX_DEV] = train[RATIO_MAX_DEV]
    return out


def without_raw(train: Mapping[str, float]) -> dict[str, float]:
    """A train step's metrics less the raw mismatch numbers (logged by `step_metrics`)."""
    return {k: v for k, v in train.items() if k not in _RAW}


def batch_metrics(trainer_logprobs: Sequence[torch.Tensor],
                  rollout_logprobs: Sequence[torch.Tensor],
                  loss_mask: Sequence[torch.Tensor]) -> dict[str, float]:
    """The logged pair from whole-batch logprobs (e.g. PPO's pi_old forward), one row a sequence."""
    merged: dict[str, float] = {}
    for lp, rp, m in zip(trainer_logprobs, rollout_logprobs, loss_mask):
        for k, v in logprob_diff_stats(lp, rp, m).items():
            merged[k] = merge_metric(k, merged.get(k, 0.0), float(v))
    return step_metrics(merged)


__all__ = ["LOGPROB_DIFF_MAX", "LOGPROB_DIFF_MEAN", "MAX_METRICS", "RATIO_MAX_DEV",
           "batch_metrics", "logprob_diff_stats", "merge_metric", "step_metrics", "without_raw"]

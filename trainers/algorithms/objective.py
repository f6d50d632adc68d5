"""The loss of one micro-batch under a ``LossConfig``: policy gradient, SFT, DPO or critic.

Inputs are tensors of one micro-batch (any shape, e.g. packed ``[1, L]`` or padded ``[R, L]``)
with ``weights`` from ``aggregation.loss_token_weights`` computed over the *whole* batch, so
summing the returned losses over micro-batches gives the full-batch loss. The returned metrics
are weighted sums too: summed over micro-batches they are the batch-level aggregates (e.g. the
clip fraction under the configured aggregation).

RL loss per token (all terms share the aggregation weights ``w``)::

    L = sum_t w_t [ tis_t * L^pg_t + kl_coef * KL_t - entropy_coef * H_t ]

with ``L^pg`` from ``ppo_clip_loss`` or ``gspo_loss``, ``tis_t = min(pi_old/pi_rollout, C)``
when ``tis_cap`` is set, ``KL_t`` from ``kl.kl_estimate`` when ``kl_mode == "loss"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from palaestra.errors import ConfigError
from palaestra.trainers.algorithms.config import LossConfig
from palaestra.trainers.algorithms.kl import kl_estimate
from palaestra.trainers.algorithms.mismatch import MAX_METRICS, logprob_diff_stats, merge_metric
from palaestra.trainers.algorithms.policy_loss import gspo_loss, ppo_clip_loss, tis_weights
from palaestra.trainers.algorithms.supervised import dpo_loss
from palaestra.trainers.algorithms.value_loss import clipped_value_loss

if TYPE_CHECKING:
    from palaestra.trainers.batching import TrainBatch

Metrics = dict[str, torch.Tensor]


def _wsum(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return torch.where(weights > 0, weights * values, 0.0).sum()


def rl_loss(
    cfg: LossConfig,
    *,
    logp: torch.Tensor,
    weights: torch.Tensor,
    loss_mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    seq_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Policy-gradient loss of a micro-batch and its weighted-sum metrics.

    ``old_logp=None`` means on-policy: the behaviour policy is the current one (ratio 1 with
    the policy-gradient gradient).
    """
    old = logp.detach() if old_logp is None else old_logp
    if cfg.policy_loss == "gspo":
        pg = gspo_loss(
            logp, old, advantages, loss_mask, seq_index=seq_index,
            eps_low=cfg.clip_eps_low, eps_high=cfg.clip_eps_high,
        )
    else:
        pg = ppo_clip_loss(
            logp, old, advantages, eps_low=cfg.clip_eps_low, eps_high=cfg.clip_eps_high,
            dual_clip_c=cfg.dual_clip_c,
        )
    token_loss = pg.loss
    metrics: Metrics = {f"actor/{k}": _wsum(weights, v) for k, v in pg.stats.items()}
    if cfg.tis_cap is not None:
        if rollout_logp is None:
            raise ConfigError(
                "tis_cap is set but the batch has no rollout_logprobs; build it with "
                "TrainBatch.from_samples or unset tis_cap"
            )
        tis = tis_weights(old, rollout_logp, cfg.tis_cap)
        token_loss = token_loss * tis
        metrics["actor/tis_weight"] = _wsum(weights, tis)
    pg_loss = _wsum(weights, token_loss)
    loss = pg_loss
    metrics["actor/pg_loss"] = pg_loss.detach()
    if cfg.kl_coef > 0 and cfg.kl_mode == "loss":
        if ref_logp is None:
            raise ConfigError(
                "kl_coef > 0 needs reference logprobs; set ref_logprobs on the batch "
                "(TorchBackend.forward_logprobs(batch, ref=True)) or enable the backend's ref model"
            )
        kl = _wsum(weights, kl_estimate(logp, ref_logp, cfg.kl_estimator))
        loss = loss + cfg.kl_coef * kl
        metrics["actor/kl"] = kl.detach()
    elif ref_logp is not None:
        metrics["actor/kl"] = _wsum(weights, kl_estimate(logp.detach(), ref_logp, cfg.kl_estimator))
    if entropy is not None:
        ent = _wsum(weights, entropy)
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * ent
        metrics["actor/entropy"] = ent.detach()
    if rollout_logp is not None:
        # k3 of the trainer's vs the engine's logprobs: how off-policy the rollout really is
        metrics["actor/rollout_kl"] = _wsum(weights, kl_estimate(logp.detach(), rollout_logp, "k3"))
        metrics.update(logprob_diff_stats(logp.detach(), rollout_logp, loss_mask))
    if cfg.skip_zero_advantage:  # the trained share of the loss weight (`as_batch_means`)
        metrics[TRAINED_WEIGHT] = _wsum(weights, torch.ones_like(weights))
    metrics["loss"] = loss.detach()
    return loss, metrics


#: with ``skip_zero_advantage``: the loss weight of the sequences that trained (summed over
#: micro-batches and ranks; `as_batch_means` turns it into their share of the batch's)
TRAINED_WEIGHT = "actor/trained_weight"
#: weighted sums of rl_loss that are exact whatever was skipped (skipped tokens add 0 to them)
_EXACT_SUMS = frozenset({"loss", "actor/pg_loss", TRAINED_WEIGHT})


def as_batch_means(metrics: dict[str, float], batch: TrainBatch, cfg: LossConfig
                   ) -> dict[str, float]:
    """A train step's metrics with the per-token statistics of the sequences that trained
    (``skip_zero_advantage``) scaled to the batch's loss weight, so ``actor/entropy``,
    ``actor/clip_frac``, ... read as without skipping, and ``actor/trained_weight`` as the
    trained share (1.0: nothing was skipped). ``loss`` and ``actor/pg_loss`` are exact already."""
    trained = metrics.get(TRAINED_WEIGHT)
    if trained is None:
        return metrics
    total = float(sum(float(w.sum()) for w in batch_loss_weights(batch, cfg)))
    if trained <= 0.0 or total <= 0.0:
        return {**metrics, TRAINED_WEIGHT: 0.0}
    scale = total / trained
    out = {k: (v * scale if k.startswith("actor/") and k not in _EXACT_SUMS else v)
           for k, v in metrics.items()}
    out[TRAINED_WEIGHT] = trained / total
    return out


def sft_loss_micro(
    *, logp: torch.Tensor, weights: torch.Tensor, entropy: torch.Tensor | None = None
) -> tuple[torch.Tensor, Metrics]:
    """SFT: aggregated NLL of the loss tokens."""
    loss = _wsum(weights, -logp)
    metrics: Metrics = {"loss": loss.detach(), "sft/nll": loss.detach()}
    if entropy is not None:
        metrics["sft/entropy"] = _wsum(weights, entropy)
    return loss, metrics


def sequence_sums(
    values: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor
) -> torch.Tensor:
    """Masked sum of ``values`` per local sequence (``seq_index`` >= 0), shape ``[k]``."""
    flat = seq_index.reshape(-1)
    valid = flat >= 0
    num = int(flat.max().item()) + 1 if valid.any() else 0
    contrib = torch.where(valid, (values * mask.to(values.dtype)).reshape(-1), 0.0)
    out = torch.zeros(num, dtype=values.dtype, device=values.device)
    return out.index_add(0, torch.where(valid, flat, 0), contrib)


def dpo_loss_micro(
    cfg: LossConfig,
    *,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_index: torch.Tensor,
    pair_weights: torch.Tensor,
) -> tuple[torch.Tensor, Metrics]:
    """DPO over the pairs of a micro-batch; local sequences ``2k``/``2k+1`` are chosen/rejected.

    ``pair_weights[k]`` is pair ``k``'s share of the batch loss (``1 / num_pairs``).
    """
    policy = sequence_sums(logp, loss_mask, seq_index)
    ref = sequence_sums(ref_logp, loss_mask, seq_index)
    out = dpo_loss(
        policy[0::2], policy[1::2], ref[0::2], ref[1::2],
        beta=cfg.dpo_beta, label_smoothing=cfg.dpo_label_smoothing,
    )
    loss = (pair_weights * out.loss).sum()
    metrics: Metrics = {"loss": loss.detach()}
    metrics.update({f"dpo/{k[4:]}": (pair_weights * v).sum() for k, v in out.stats.items()})
    return loss, metrics


PAIR_WEIGHT = "pair_weight"
"""Micro-batch sequence field: each DPO pair's share of the batch loss (on both members)."""


def sequence_fields(num_sequences: int, cfg: LossConfig, *, critic: bool = False
                    ) -> dict[str, torch.Tensor]:
    """Per-sequence fields the objective reads from micro-batches (DPO: `PAIR_WEIGHT`)."""
    if cfg.objective != "dpo" or critic:
        return {}
    return {PAIR_WEIGHT: torch.full((num_sequences,), 2.0 / num_sequences)}


def batch_loss_weights(batch: TrainBatch, cfg: LossConfig) -> tuple[torch.Tensor, ...]:
    """Per-sequence 1-D aggregation weights of a whole TrainBatch (``sum(w * loss)`` is the batch
    loss); DPO always aggregates token-mean."""
    from palaestra.trainers.algorithms.aggregation import loss_token_weights
    from palaestra.trainers.batching import unpad

    mode = cfg.loss_agg if cfg.objective != "dpo" else "token-mean"
    group = batch.group_index() if mode == "group-mean-token-mean" else None
    weights = loss_token_weights(batch.padded("loss_mask"), mode, group_index_B=group,
                                 norm_len=cfg.loss_agg_norm_len)
    return unpad(weights, batch.lengths)


def check_train_batch(batch: TrainBatch, cfg: LossConfig, *, critic: bool = False) -> None:
    """Raise a ConfigError naming what ``batch`` (a TrainBatch) lacks for this objective."""
    if critic:
        need = ["returns", "old_values"]
    elif cfg.objective == "rl":
        need = ["advantages"]
    elif cfg.objective == "dpo":
        if not batch.paired:
            raise ConfigError("objective='dpo' needs a paired batch (TrainBatch.from_pairs)")
        need = ["ref_logprobs"]
    else:
        need = []
    missing = [n for n in need if getattr(batch, n) is None]
    if missing:
        raise ConfigError(
            f"train_step({'critic' if critic else cfg.objective}) needs {missing} on the batch; "
            "compute_advantages() fills advantages (and returns/old_values for GAE), "
            "forward_logprobs(batch, ref=True) the reference logprobs"
        )


def value_loss_micro(
    cfg: LossConfig,
    *,
    values: torch.Tensor,
    weights: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
) -> tuple[torch.Tensor, Metrics]:
    """Critic loss (clipped value loss) of a micro-batch."""
    out = clipped_value_loss(values, old_values, returns, clip=cfg.value_clip)
    loss = _wsum(weights, out.loss)
    metrics: Metrics = {
        "loss": loss.detach(),
        "critic/value_loss": loss.detach(),
        "critic/value_clip_frac": _wsum(weights, out.stats["value_clip_frac"]),
        "critic/values": _wsum(weights, values.detach()),
    }
    return loss, metrics


__all__ = [
    "MAX_METRICS",
    "PAIR_WEIGHT",
    "TRAINED_WEIGHT",
    "as_batch_means",
    "batch_loss_weights",
    "check_train_batch",
    "dpo_loss_micro",
    "merge_metric",
    "rl_loss",
    "sequence_fields",
    "sequence_sums",
    "sft_loss_micro",
    "value_loss_micro",
]

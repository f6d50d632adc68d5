"""``compute_advantages``: from a batch's rewards to per-token advantages under a ``LossConfig``.

The glue between rollout samples and the pure estimators of ``advantages``:

- The reward signal of a sample is its outcome ``reward`` or, with ``use_turn_rewards``, its
  per-turn rewards (each turn's tokens get the discounted return from that turn, ``G_k``).
- Group estimators (GRPO, Dr. GRPO, RLOO) compute a baseline (and scale) from the group's
  episode returns ``G_0``; a token of turn ``k`` gets ``(G_k - baseline_i) / scale_i``. With
  outcome rewards only this is the usual ``(r_i - baseline_i) / scale_i`` on every token.
- Token estimators (REINFORCE++, REINFORCE++-baseline, GAE) place the outcome reward on the
  last sampled token (per-turn rewards on each turn's last sampled token) and recurse backwards.
- KL as reward (``kl_mode="reward"``): ``r_t -= kl_coef * KL_t`` per token for the token
  estimators; group estimators subtract the summed penalty from the episode score.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from palaestra.errors import ConfigError
from palaestra.trainers.algorithms import advantages as adv_lib
from palaestra.trainers.algorithms.config import LossConfig
from palaestra.trainers.algorithms.kl import kl_estimate
from palaestra.trainers.batching import TrainBatch, pad_ragged, unpad

_GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def _kl_penalty_BT(
    batch: TrainBatch, cfg: LossConfig, mask_BT: torch.Tensor
) -> torch.Tensor | None:
    if not (cfg.kl_mode == "reward" and cfg.kl_coef > 0):
        return None
    logp = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
    if logp is None or batch.ref_logprobs is None:
        raise ConfigError(
            "kl_mode='reward' needs the policy's and the reference's logprobs on the batch "
            "(old_logprobs or rollout_logprobs, and ref_logprobs) before compute_advantages"
        )
    kl = kl_estimate(pad_ragged(logp), pad_ragged(batch.ref_logprobs), cfg.kl_estimator)
    return -cfg.kl_coef * kl * mask_BT


def _token_rewards_BT(batch: TrainBatch, cfg: LossConfig, mask_BT: torch.Tensor) -> torch.Tensor:
    """Rewards placed on tokens: outcome on the last sampled token, or per turn."""
    if cfg.use_turn_rewards:
        turn_rewards, turn_ends = _turn_data(batch)
        rows = [
            adv_lib.turn_token_rewards(r, e, m)
            for r, e, m in zip(turn_rewards, turn_ends, batch.loss_mask)
        ]
        return pad_ragged(rows)
    return adv_lib.outcome_token_rewards(_rewards(batch), mask_BT)


def _rewards(batch: TrainBatch) -> torch.Tensor:
    if batch.rewards is None:
        raise ConfigError("the batch has no rewards; build it with TrainBatch.from_samples")
    return batch.rewards


def _turn_data(batch: TrainBatch) -> tuple[Sequence[Sequence[float]], Sequence[Sequence[int]]]:
    if batch.turn_rewards is None or batch.turn_ends is None:
        raise ConfigError(
            "use_turn_rewards=True but the batch has no turn_rewards/turn_ends; the rollout must "
            "fill Sample.turn_rewards and Sample.turn_ends"
        )
    missing = [i for i, r in enumerate(batch.turn_rewards) if not r]
    if missing:
        raise ConfigError(
            f"use_turn_rewards=True but samples {missing[:5]} have no turn rewards; "
            "set use_turn_rewards=False to train on the outcome reward"
        )
    return batch.turn_rewards, batch.turn_ends


def _group_advantages(
    batch: TrainBatch, cfg: LossConfig, mask_BT: torch.Tensor, penalty_BT: torch.Tensor | None
) -> torch.Tensor:
    if batch.group_ids is None or any(not g for g in batch.group_ids):
        raise ConfigError(
            f"advantage_estimator={cfg.advantage_estimator!r} compares samples of the same prompt "
            "and needs a group_id on every sample (rollout with n > 1 samples per prompt)"
        )
    group = batch.group_index()
    if cfg.use_turn_rewards:
        turn_rewards, turn_ends = _turn_data(batch)
        signal_BT = pad_ragged([
            adv_lib.turn_returns_to_tokens(r, e, m, gamma=cfg.gamma)
            for r, e, m in zip(turn_rewards, turn_ends, batch.loss_mask)
        ])
        scores = torch.tensor([adv_lib.turn_returns(r, cfg.gamma)[0] for r in turn_rewards])
    else:
        scores = _rewards(batch).clone()
        signal_BT = scores[:, None] * mask_BT
    if penalty_BT is not None:
        total = penalty_BT.sum(-1)
        scores = scores + total
        signal_BT = signal_BT + total[:, None] * mask_BT
    mean, std, count = adv_lib.group_mean_std(scores, group)
    if cfg.advantage_estimator == "rloo":
        totals = mean * count
        baseline = (totals - scores) / (count - 1).clamp(min=1)
        scale = torch.ones_like(scores)
    else:
        baseline = mean
        use_std = cfg.advantage_estimator == "grpo" and cfg.norm_adv_by_std
        scale = std + 1e-6 if use_std else torch.ones_like(scores)
    out = (signal_BT - baseline[:, None]) / scale[:, None] * mask_BT
    return torch.where((count > 1)[:, None], out, 0.0)


def _tree_advantages(
    batch: TrainBatch, cfg: LossConfig, penalty_BT: torch.Tensor | None
) -> list[torch.Tensor]:
    from palaestra.trainers.algorithms.tree_advantages import tree_token_advantages

    if batch.group_ids is None or any(not g for g in batch.group_ids):
        raise ConfigError("advantage_estimator='tree' compares the leaves of a group's tree and "
                          "needs a group_id on every sample")
    if penalty_BT is not None or cfg.use_turn_rewards:
        raise ConfigError("advantage_estimator='tree' values nodes by their leaves' outcome "
                          "rewards; set use_turn_rewards=false and kl_mode='loss'")
    return tree_token_advantages(
        batch.token_ids, batch.loss_mask, batch.turn_ends or [()] * len(batch.token_ids),
        batch.group_ids, _rewards(batch).tolist(), norm_by_std=cfg.norm_adv_by_std)


def compute_advantages(
    batch: TrainBatch, cfg: LossConfig, *, values: Sequence[torch.Tensor] | None = None
) -> TrainBatch:
    """The batch with per-token ``advantages`` (and ``returns``/``old_values`` for GAE).

    ``values`` are the critic's per-token values (``TorchBackend.forward_values``); they are
    needed by GAE only and default to ``batch.old_values``.
    """
    if cfg.objective != "rl":
        raise ConfigError(f"objective={cfg.objective!r} has no advantages; use objective='rl'")
    mask_BT = pad_ragged(batch.loss_mask)
    lengths = batch.lengths
    penalty_BT = _kl_penalty_BT(batch, cfg, mask_BT)
    estimator = cfg.advantage_estimator
    if estimator == "tree":  # per-turn credit over a branching group's prefix tree
        return batch.replace(advantages=_tree_advantages(batch, cfg, penalty_BT))
    if estimator in _GROUP_ESTIMATORS:
        adv = _group_advantages(batch, cfg, mask_BT, penalty_BT)
        return batch.replace(advantages=unpad(adv, lengths))
    token_rewards = _token_rewards_BT(batch, cfg, mask_BT)
    if estimator == "reinforce_pp_baseline":
        if batch.group_ids is None or any(not g for g in batch.group_ids):
            raise ConfigError("reinforce_pp_baseline needs a group_id on every sample")
        mean = adv_lib.group_mean_std(_rewards(batch), batch.group_index())[0]
        token_rewards = token_rewards - adv_lib.outcome_token_rewards(mean, mask_BT)
    if penalty_BT is not None:
        token_rewards = token_rewards + penalty_BT
    if estimator in ("reinforce_pp", "reinforce_pp_baseline"):
        adv = adv_lib.reinforce_pp_advantages(token_rewards, mask_BT, gamma=cfg.gamma)
        return batch.replace(advantages=unpad(adv, lengths))
    if estimator == "gae":
        vals = values if values is not None else batch.old_values
        if vals is None:
            raise ConfigError(
                "advantage_estimator='gae' needs the critic's values: pass values= "
                "(TorchBackend(..., critic).forward_values(batch)) or set batch.old_values"
            )
        values_BT = pad_ragged([torch.as_tensor(v, dtype=torch.float32) for v in vals])
        adv, returns = adv_lib.gae_advantages(
            token_rewards, values_BT, mask_BT, gamma=cfg.gamma, lam=cfg.gae_lambda
        )
        adv = adv_lib.masked_whiten(adv, mask_BT)
        return batch.replace(
            advantages=unpad(adv, lengths), returns=unpad(returns, lengths),
            old_values=unpad(values_BT, lengths),
        )
    raise ConfigError(f"unknown advantage_estimator {estimator!r}")


__all__ = ["compute_advantages"]

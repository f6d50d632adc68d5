"""`ppo_step`: one rollout batch of PPO with a learned critic.

Order (verl's and OpenRLHF's)::

    reference logprobs (kl_coef > 0) -> old logprobs (more than one update, or KL in the
    reward) -> critic values
    -> GAE (token level; per-turn rewards on each turn's last sampled token with
       use_turn_rewards; tool/env tokens masked, skipped by the recursion) -> returns, whitened
       advantages -> updates_per_batch epochs over shuffled mini-batches of mini_batch_size
       samples: a critic step (clipped value loss) and an actor step (PPO clip, dual clip,
       clip-higher) per mini-batch

The first ``critic.warmup_steps`` RL steps train the critic only. The loop pushes the actor's
weights afterwards; the critic never goes to the engines. Mini-batch order is drawn from
``(seed, step, epoch)`` alone, so a resumed run trains on the same mini-batches.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from palaestra.trainers.algorithms.estimators import compute_advantages
from palaestra.trainers.algorithms.objective import as_batch_means
from palaestra.trainers.batching import TrainBatch

if TYPE_CHECKING:
    from palaestra.contracts import TrainerBackend
    from palaestra.trainers.algorithms.config import LossConfig
    from palaestra.trainers.ppo.config import CriticSection

    Actor = TrainerBackend[TrainBatch, LossConfig]


class Critic(Protocol):
    """PPO's value model (a backend built with a value head): what a step and a checkpoint
    call on it. It never goes to the engines."""

    def forward_values(self, batch: TrainBatch) -> list[torch.Tensor]:
        """``V_t`` (estimated before token ``t``), one tensor per sequence."""
        ...

    def train_step(self, batch: TrainBatch, loss_cfg: LossConfig, /) -> dict[str, float]:
        """One optimizer step of the value loss; float metrics."""
        ...

    def save(self, directory: str | Path, /, *, extra: dict[str, object] | None = None) -> Path:
        ...

    def load(self, directory: str | Path, /) -> dict[str, object]:
        ...

    def export_hf(self, directory: str | Path, /, *, dtype: torch.dtype | None = None) -> Path:
        ...


class PPOTrainerSettings(Protocol):
    """The ``[trainer]`` settings `ppo_step` reads (`palaestra.run.config.TrainerSection`)."""

    @property
    def loss(self) -> LossConfig: ...
    @property
    def updates_per_batch(self) -> int: ...
    @property
    def mini_batch_size(self) -> int | None: ...


class PPOSettings(Protocol):
    """The run settings `ppo_step` reads (a `palaestra.run.config.TrainConfig` has them)."""

    @property
    def seed(self) -> int: ...
    @property
    def trainer(self) -> PPOTrainerSettings: ...
    @property
    def critic(self) -> CriticSection: ...


def update_skipped(metrics: dict[str, float]) -> bool:
    """Whether the backend skipped the optimizer step: non-finite gradient norm (torch) or
    ``update_ok == 0`` (Megatron's optimizer found inf/NaN)."""
    grad_norm = metrics.get("grad_norm")
    bad_norm = grad_norm is not None and not math.isfinite(float(grad_norm))
    return bad_norm or metrics.get("update_ok", 1.0) == 0.0


@dataclass
class PPOStepResult:
    """What one PPO step did: the batch with advantages, mean metrics of the actor's and the
    critic's updates (critic keys under ``critic/``, batch statistics under ``ppo/``), seconds
    per part (``time/...``) and the updates whose gradients were not finite."""

    batch: TrainBatch
    metrics: dict[str, float]
    times: dict[str, float]
    skipped: list[str] = field(default_factory=list)


def value_stats(batch: TrainBatch) -> dict[str, float]:
    """Explained variance ``1 - Var(R - V) / Var(R)``, mean value and mean return, and the
    raw (unwhitened) GAE advantage ``R - V`` statistics over the sampled tokens."""
    mask = batch.padded("loss_mask") > 0
    values = batch.padded("old_values")[mask].double()
    returns = batch.padded("returns")[mask].double()
    if values.numel() < 2:
        return {}
    raw = returns - values
    var_r = returns.var()
    explained = 1.0 - raw.var() / var_r if var_r > 0 else torch.tensor(float("nan"))
    return {
        "ppo/explained_variance": float(explained),
        "ppo/value_mean": float(values.mean()), "ppo/return_mean": float(returns.mean()),
        "ppo/advantage_mean": float(raw.mean()), "ppo/advantage_std": float(raw.std()),
        "ppo/advantage_min": float(raw.min()), "ppo/advantage_max": float(raw.max()),
    }


def mini_batches(num: int, size: int | None, *, seed: int, step: int, epoch: int
                 ) -> list[list[int]]:
    """Sample indices of an epoch's mini-batches: all in order when ``size`` covers the batch,
    else a permutation drawn from ``(seed, step, epoch)`` cut into pieces of ``size``."""
    if size is None or size >= num:
        return [list(range(num))]
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + epoch)
    order = torch.randperm(num, generator=gen).tolist()
    return [order[i:i + size] for i in range(0, num, size)]


def _mean(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for r in rows for k in r}
    return {k: sum(r[k] for r in rows if k in r) / sum(k in r for r in rows) for k in keys}


def _as_critic_keys(metrics: dict[str, float]) -> dict[str, float]:
    return {k if k.startswith("critic/") else f"critic/{k}": v for k, v in metrics.items()}


def ppo_step(cfg: PPOSettings, actor: Actor, critic: Critic, batch: TrainBatch, step: int
             ) -> PPOStepResult:
    """Values, GAE and the PPO epochs of rollout batch ``step`` (see the module docstring)."""
    loss = cfg.trainer.loss
    critic_loss = loss.model_copy(update={"value_clip": cfg.critic.value_clip})
    times: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        times[name] = times.get(name, 0.0) + now - clock
        clock = now

    n = batch.num_sequences
    epochs = cfg.trainer.updates_per_batch
    plans = [mini_batches(n, cfg.trainer.mini_batch_size, seed=cfg.seed, step=step, epoch=e)
             for e in range(epochs)]
    train_actor = step >= cfg.critic.warmup_steps
    if loss.kl_coef > 0:
        batch = batch.replace(ref_logprobs=actor.forward_logprobs(batch, ref=True))
    reward_kl = loss.kl_coef > 0 and loss.kl_mode == "reward"
    # pi_old: the ratio's denominator after the first update, and the KL penalty's policy side
    if reward_kl or (train_actor and sum(len(p) for p in plans) > 1):
        batch = batch.replace(old_logprobs=actor.forward_logprobs(batch))
    lap("time/logprobs_s")
    values = critic.forward_values(batch)
    lap("time/values_s")
    batch = compute_advantages(batch, loss, values=values)
    metrics = value_stats(batch)
    actor_rows: list[dict[str, float]] = []
    critic_rows: list[dict[str, float]] = []
    skipped: list[str] = []
    for epoch, plan in enumerate(plans):
        for indices in plan:
            mini = batch if len(indices) == n else batch.select(indices)
            out = critic.train_step(mini, critic_loss)
            critic_rows.append(out)
            if update_skipped(out):
                skipped.append(f"critic (epoch {epoch})")
            lap("time/critic_update_s")
            if train_actor:
                out = as_batch_means(dict(actor.train_step(mini, loss)), mini, loss)
                actor_rows.append(out)
                if update_skipped(out):
                    skipped.append(f"actor (epoch {epoch})")
                lap("time/actor_update_s")
    metrics.update(_mean(actor_rows))
    metrics.update(_as_critic_keys(_mean(critic_rows)))
    metrics["ppo/actor_updates"] = float(len(actor_rows))
    metrics["ppo/critic_updates"] = float(len(critic_rows))
    times["time/critic_s"] = times["time/values_s"] + times.get("time/critic_update_s", 0.0)
    times["time/actor_s"] = times["time/logprobs_s"] + times.get("time/actor_update_s", 0.0)
    return PPOStepResult(batch, metrics, times, skipped)


def with_reward_kl_logprobs(actor: Actor, batch: TrainBatch, loss: LossConfig) -> TrainBatch:
    """The batch with reference logprobs when the KL is a reward penalty (``kl_mode =
    "reward"``): they must be there before the advantages (any estimator)."""
    if loss.kl_coef > 0 and loss.kl_mode == "reward" and batch.ref_logprobs is None:
        return batch.replace(ref_logprobs=actor.forward_logprobs(batch, ref=True))
    return batch


__all__ = ["Critic", "PPOSettings", "PPOStepResult", "mini_batches", "ppo_step", "update_skipped", "value_stats",
           "with_reward_kl_logprobs"]

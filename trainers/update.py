"""The learner's one entry: ``update(samples, step) -> UpdateResult``.

The RL loop hands the learner a rollout batch's samples and gets back what the update did; the
recipe lives here, not in the loop:

- `PolicyUpdate` (GRPO, Dr.GRPO, RLOO, REINFORCE++ and the other critic-free estimators):
  reference logprobs when the KL is a reward penalty -> advantages -> the teacher's scores
  (on-policy distillation, when a teacher is loaded) -> ``updates_per_batch`` optimizer steps.
- `PPOUpdate` (a learned critic): values, GAE, the PPO epochs of critic and actor updates
  (`palaestra.trainers.ppo.step.ppo_step`).

Both report the same `UpdateResult`: the train metrics to log, the rollout/train logprob
mismatch (``rollout/logprob_{max,mean}_abs_diff``: the trainer's logprobs under the weights that
sampled the batch against the engine's), the seconds of each part and the updates whose
gradients were not finite (skipped by the backend). The weights then go to the engines by the
run's push; the learner never calls back into the loop.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from palaestra.trace_ranges import span

if TYPE_CHECKING:
    import torch

    from palaestra.contracts import TrainerBackend
    from palaestra.trainers.algorithms.config import LossConfig
    from palaestra.trainers.batching import TrainBatch
    from palaestra.trainers.ppo.step import Critic, PPOSettings
    from palaestra.types import Sample

@dataclass(frozen=True)
class UpdateResult:
    """What one update did to the policy (and the critic)."""

    batch: TrainBatch  # the batch with its advantages (and values, for PPO)
    metrics: dict[str, float]  # the train metrics to log (``train/*``)
    mismatch: dict[str, float]  # rollout/logprob_{max,mean}_abs_diff, before the update
    times: dict[str, float] = field(default_factory=dict)  # PPO's parts: time/values_s, ...
    skipped: list[str] = field(default_factory=list)  # updates whose gradients were not finite
    extra: dict[str, float] = field(default_factory=dict)  # distill/* (with a teacher)


class Learner(Protocol):
    """What the RL loop calls once per step (`PolicyUpdate`, `PPOUpdate`)."""

    def update(self, samples: Sequence[Sample], step: int) -> UpdateResult:
        """Advantages and optimizer steps on the samples of rollout batch ``step``."""
        ...


class TeacherScoring(Protocol):
    """A backend holding the frozen teacher of on-policy distillation."""

    def forward_teacher_logprobs(self, batch: TrainBatch) -> list[torch.Tensor]:
        """The teacher's logprob of every token of ``batch``, aligned like the policy's."""
        ...


@dataclass(frozen=True)
class Distillation:
    """On-policy distillation: the teacher's scores as advantages (``[distill]``)."""

    teacher: TeacherScoring
    coef: float
    reward_coef: float

    def apply(self, batch: TrainBatch) -> tuple[TrainBatch, dict[str, float]]:
        """The batch with the distillation advantages and the step's ``distill/*`` metrics
        (``distill/reverse_kl``, ``distill/teacher_s``)."""
        from palaestra.trainers.algorithms.distill import distill_advantages

        start = time.perf_counter()
        scores = self.teacher.forward_teacher_logprobs(batch)
        batch, metrics = distill_advantages(batch, scores, coef=self.coef,
                                            reward_coef=self.reward_coef)
        metrics["distill/teacher_s"] = time.perf_counter() - start
        return batch, metrics


def _train_batch(samples: Sequence[Sample]) -> TrainBatch:
    from palaestra.trainers.batching import TrainBatch

    with span("trainer_data"):
        return TrainBatch.from_samples(samples)


class PolicyUpdate:
    """A critic-free update: advantages from the group's rewards, then ``updates_per_batch``
    optimizer steps on the whole batch (see the module doc)."""

    def __init__(self, policy: TrainerBackend[TrainBatch, LossConfig], loss: LossConfig, *,
                 updates_per_batch: int = 1, distill: Distillation | None = None) -> None:
        self.policy, self.loss = policy, loss
        self.updates_per_batch = updates_per_batch
        self.distill = distill

    def update(self, samples: Sequence[Sample], step: int) -> UpdateResult:
        from palaestra.trainers.algorithms.estimators import compute_advantages
        from palaestra.trainers.algorithms.mismatch import step_metrics, without_raw
        from palaestra.trainers.algorithms.objective import as_batch_means
        from palaestra.trainers.ppo.step import update_skipped, with_reward_kl_logprobs

        batch = compute_advantages(
            with_reward_kl_logprobs(self.policy, _train_batch(samples), self.loss), self.loss)
        extra: dict[str, float] = {}
        if self.distill is not None:  # the teacher scores every sampled token
            batch, extra = self.distill.apply(batch)
        metrics: dict[str, float] = {}
        first: dict[str, float] = {}
        skipped: list[str] = []
        for update in range(self.updates_per_batch):
            metrics = as_batch_means(dict(self.policy.train_step(batch, self.loss)), batch,
                                     self.loss)
            if update == 0:  # the weights that sampled the batch: the logprob mismatch of
                # the first update's forward (all its micro-batches run before the step)
                first = step_metrics(metrics)
            if update_skipped(metrics):
                skipped.append(f"the gradients are not finite (grad norm "
                               f"{metrics.get('grad_norm')}, loss {metrics.get('loss')})")
        return UpdateResult(batch, without_raw(metrics), first, skipped=skipped, extra=extra)


class PPOUpdate:
    """PPO with a learned critic: values, GAE and epochs of critic and actor updates."""

    def __init__(self, settings: PPOSettings, actor: TrainerBackend[TrainBatch, LossConfig],
                 critic: Critic) -> None:
        self.settings, self.actor, self.critic = settings, actor, critic

    def update(self, samples: Sequence[Sample], step: int) -> UpdateResult:
        from palaestra.trainers.algorithms.mismatch import batch_metrics, step_metrics, without_raw
        from palaestra.trainers.ppo.step import ppo_step

        ppo = ppo_step(self.settings, self.actor, self.critic, _train_batch(samples), step)
        b, train = ppo.batch, ppo.metrics
        # the mismatch: from the pi_old forward of the whole batch when it ran one, else from
        # the single actor update's own forward
        if b.old_logprobs is not None and b.rollout_logprobs is not None:
            mismatch = batch_metrics(b.old_logprobs, b.rollout_logprobs, b.loss_mask)
        else:
            mismatch = step_metrics(train) if train.get("ppo/actor_updates") == 1.0 else {}
        skipped = [f"{what}: the gradients are not finite" for what in ppo.skipped]
        return UpdateResult(b, without_raw(train), mismatch, times=ppo.times, skipped=skipped)


__all__ = ["Distillation", "Learner", "PPOUpdate", "PolicyUpdate", "TeacherScoring",
           "UpdateResult"]

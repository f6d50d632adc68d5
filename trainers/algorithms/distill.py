"""On-policy distillation: per-token reverse KL to a teacher as a (negative) advantage.

The student samples (the normal rollout), the teacher scores every sampled token, and each
trained token ``x_t`` gets the advantage::

    A_t = reward_coef * A^reward_t - coef * (log p_student(x_t) - log p_teacher(x_t))

where ``log p_student - log p_teacher`` on the student's own samples is the one-sample estimate
of the per-token reverse KL ``KL(p_student || p_teacher)``; the policy-gradient loss then
minimises it (with ``A^reward`` the env-reward advantage of the configured estimator, e.g. GRPO;
``reward_coef = 0``: pure distillation). This is tinker-cookbook's on-policy distillation
(``tinker_cookbook/distillation``: ``incorporate_kl_penalty`` adds ``-kl_penalty_coef *
(sampled_logprobs - teacher_logprobs)`` to the advantages, with the sampler's logprobs as the
student's) and Thinking Machines' "On-Policy Distillation" (2025); NeMo-RL and verl optimise
the same reverse KL. The student's logprobs are the engine's (``rollout_logprobs``), as there:
no extra student forward, and `mismatch` logs how far they are from the trainer's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from palaestra.errors import ConfigError
from palaestra.trainers.batching import TrainBatch

#: the per-token reverse KL estimate, averaged over the trained tokens of the batch
REVERSE_KL = "distill/reverse_kl"


def distill_advantages(batch: TrainBatch, teacher_logprobs: Sequence[torch.Tensor], *,
                       coef: float, reward_coef: float) -> tuple[TrainBatch, dict[str, float]]:
    """``batch`` with the advantages above, and ``distill/reverse_kl`` (mean over trained
    tokens of ``log p_student - log p_teacher``). ``batch`` needs ``rollout_logprobs`` and,
    when ``reward_coef > 0``, its reward ``advantages``."""
    if batch.rollout_logprobs is None:
        raise ConfigError("distillation needs the sampled tokens' logprobs (rollout_logprobs): "
                         "build the batch with TrainBatch.from_samples")
    if reward_coef > 0 and batch.advantages is None:
        raise ConfigError("reward_coef > 0 needs the batch's reward advantages")
    advantages: list[torch.Tensor] = []
    kl_sum, tokens = 0.0, 0
    for i, (student_T, teacher_T, mask_T) in enumerate(
            zip(batch.rollout_logprobs, teacher_logprobs, batch.loss_mask)):
        trained = mask_T > 0
        reverse_kl_T = torch.where(trained, student_T.float() - teacher_T.float(), 0.0)
        adv_T = -coef * reverse_kl_T
        if reward_coef > 0:
            assert batch.advantages is not None
            adv_T = adv_T + reward_coef * batch.advantages[i]
        advantages.append(adv_T)
        kl_sum += float(reverse_kl_T.sum())
        tokens += int(trained.sum())
    metrics = {REVERSE_KL: kl_sum / tokens if tokens else 0.0,
               "distill/teacher_logprob": _mean_trained(teacher_logprobs, batch.loss_mask)}
    return batch.replace(advantages=tuple(advantages)), metrics


def _mean_trained(values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> float:
    total = sum(float(torch.where(m > 0, v.float(), 0.0).sum()) for v, m in zip(values, masks))
    count = sum(int((m > 0).sum()) for m in masks)
    return total / count if count else 0.0


__all__ = ["REVERSE_KL", "distill_advantages"]

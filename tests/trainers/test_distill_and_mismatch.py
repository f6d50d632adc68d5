"""The distillation advantages by hand, the teacher forward, and the logprob-mismatch metric's
aggregation over micro-batches (max, not sum)."""

from __future__ import annotations

import pytest
import torch

from palaestra.trainers.algorithms.config import LossConfig
from palaestra.trainers.algorithms.distill import distill_advantages
from palaestra.trainers.algorithms.mismatch import batch_metrics, step_metrics
from palaestra.trainers.batching import TrainBatch
from palaestra.trainers.torch_backend.backend import TorchBackend
from palaestra.trainers.torch_backend.config import TorchBackendConfig
from tests.trainers.test_torch_backend import make_batch, model_dir

pytestmark = pytest.mark.numerics  # distillation and mismatch corrections on logprobs

__all__ = ["model_dir"]  # the fixture, imported for pytest


def _batch() -> TrainBatch:
    return TrainBatch(token_ids=[[1, 2, 3], [4, 5]], loss_mask=[[0, 1, 1], [0, 1]],
                      rollout_logprobs=[[0.0, -1.0, -0.5], [0.0, -2.0]],
                      advantages=[[0.0, 1.0, 1.0], [0.0, -1.0]])


def test_distill_advantages_by_hand():
    teacher = [torch.tensor([0.0, -3.0, -0.5]), torch.tensor([0.0, -1.0])]
    out, metrics = distill_advantages(_batch(), teacher, coef=2.0, reward_coef=0.0)
    assert out.advantages is not None
    # -coef * (student - teacher) on trained tokens, 0 elsewhere
    assert torch.equal(out.advantages[0], torch.tensor([0.0, -4.0, 0.0]))
    assert torch.equal(out.advantages[1], torch.tensor([0.0, 2.0]))
    assert metrics["distill/reverse_kl"] == pytest.approx((2.0 + 0.0 - 1.0) / 3)
    mixed, _ = distill_advantages(_batch(), teacher, coef=1.0, reward_coef=0.5)
    assert mixed.advantages is not None
    assert torch.equal(mixed.advantages[0], torch.tensor([0.0, -1.5, 0.5]))
    assert torch.equal(mixed.advantages[1], torch.tensor([0.0, 0.5]))


def test_teacher_forward_matches_the_policy_forward_of_the_same_weights(model_dir):
    torch.set_num_threads(1)
    backend = TorchBackend(model_dir, TorchBackendConfig(device="cpu", dtype="float32"))
    backend.load_teacher(model_dir)
    batch = make_batch()
    for a, b in zip(backend.forward_teacher_logprobs(batch), backend.forward_logprobs(batch)):
        assert torch.equal(a, b)


def test_mismatch_max_is_the_max_over_micro_batches(model_dir):
    """Many micro-batches: the logged max is the largest token's |diff| and the mean the token
    mean, as computed from one whole-batch forward with the same weights."""
    torch.set_num_threads(1)
    backend = TorchBackend(model_dir, TorchBackendConfig(
        device="cpu", dtype="float32", max_tokens_per_micro_batch=24, pack_sequences=False))
    batch = make_batch()
    expected = batch_metrics(backend.forward_logprobs(batch), batch.rollout_logprobs,
                             batch.loss_mask)
    metrics = backend.train_step(batch, LossConfig(preset="grpo"))
    assert metrics["num_micro_batches"] > 2
    got = step_metrics(metrics)
    assert got["rollout/logprob_max_abs_diff"] == pytest.approx(
        expected["rollout/logprob_max_abs_diff"], abs=1e-4)
    assert got["rollout/logprob_mean_abs_diff"] == pytest.approx(
        expected["rollout/logprob_mean_abs_diff"], abs=1e-4)
    assert 0 < got["rollout/logprob_mean_abs_diff"] < got["rollout/logprob_max_abs_diff"]

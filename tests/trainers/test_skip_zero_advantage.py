"""``skip_zero_advantage``: sequences without a learning signal leave the train step, and the
update is the same.

The premise is built, not hoped for: every sequence trains in a micro-batch of its own in the
same order with and without skipping, and a zero-advantage sequence's gradient is exactly zero,
so the two optimizer steps see bit-identical gradients on any CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from palaestra.trainers.algorithms.config import LossConfig
from palaestra.trainers.algorithms.objective import (
    TRAINED_WEIGHT,
    as_batch_means,
    batch_loss_weights,
)
from palaestra.trainers.batching import TrainBatch
from palaestra.trainers.loss_inputs import loss_micro_batches, sequences_with_signal
from palaestra.trainers.torch_backend.backend import TorchBackend
from palaestra.trainers.torch_backend.config import TorchBackendConfig
from tests.trainers.test_torch_backend import tiny_qwen3

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_skip"))


def sparse_batch(n: int = 8, prompt: int = 3) -> TrainBatch:
    """Two groups of four: the first all alike (advantages 0), the second with signal, and one
    sequence of the second with advantage 0 too (its own reward was the group's mean)."""
    g = torch.Generator().manual_seed(3)
    ids, masks, adv, rollout = [], [], [], []
    signs = [0.0, 0.0, 0.0, 0.0, 1.0, -1.0, 0.0, 0.5]
    for i in range(n):
        length = 10 + (i * 5) % 9  # 10..18: two never share a micro-batch of 18 tokens
        ids.append(torch.randint(0, 300, (length,), generator=g))
        mask = torch.tensor([0.0] * prompt + [1.0] * (length - prompt))
        masks.append(mask)
        adv.append(mask * signs[i])
        rollout.append(mask * -5.7)
    return TrainBatch(token_ids=ids, loss_mask=masks, advantages=adv, rollout_logprobs=rollout,
                      group_ids=[f"p{i // 4}" for i in range(n)])


def one_step(model_dir: Path, loss: LossConfig, batch: TrainBatch, weight_decay: float = 0.0
             ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    # micro-batches of one sequence each (the longest is 18 tokens): the same order either way
    backend = TorchBackend(model_dir, TorchBackendConfig(
        device="cpu", lr=1e-3, max_tokens_per_micro_batch=18, pack_sequences=False,
        weight_decay=weight_decay))
    metrics = as_batch_means(dict(backend.train_step(batch, loss)), batch, loss)
    return {k: v.detach().clone() for k, v in backend.model.named_parameters()}, metrics


def test_the_update_is_the_same_for_fewer_micro_batches(model_dir: Path) -> None:
    batch = sparse_batch()
    plain = LossConfig.from_preset("grpo")
    skipping = LossConfig.from_preset("grpo", skip_zero_advantage=True)
    weights_plain, metrics_plain = one_step(model_dir, plain, batch)
    weights_skip, metrics_skip = one_step(model_dir, skipping, batch)
    assert metrics_plain["num_micro_batches"] == 8.0
    assert metrics_skip["num_micro_batches"] == 3.0  # the three sequences with signal
    assert metrics_skip["grad_norm"] > 0.0
    for name, value in weights_plain.items():
        assert torch.equal(value, weights_skip[name]), name
    assert metrics_skip["loss"] == metrics_plain["loss"]
    assert metrics_skip["actor/pg_loss"] == metrics_plain["actor/pg_loss"]
    # GRPO's seq-mean-token-mean: every sequence weighs the same, three of eight trained
    assert metrics_skip[TRAINED_WEIGHT] == pytest.approx(3 / 8)
    weights = batch_loss_weights(batch, skipping)
    trained = sum(float(weights[i].sum()) for i in (4, 5, 7))
    assert trained / sum(float(w.sum()) for w in weights) == pytest.approx(3 / 8)
    assert TRAINED_WEIGHT not in metrics_plain


def test_entropy_reads_as_the_trained_sequences_mean(model_dir: Path) -> None:
    """The per-token statistics are scaled to the whole batch's weight: with every advantage
    non-zero nothing is skipped and they equal the plain step's."""
    batch = sparse_batch()
    batch = batch.replace(advantages=tuple(m * (1.0 if i % 2 else -1.0)
                                           for i, m in enumerate(batch.loss_mask)))
    _, plain = one_step(model_dir, LossConfig.from_preset("grpo"), batch)
    _, skip = one_step(model_dir, LossConfig.from_preset("grpo", skip_zero_advantage=True), batch)
    assert skip[TRAINED_WEIGHT] == pytest.approx(1.0)
    assert skip["actor/entropy"] == pytest.approx(plain["actor/entropy"], rel=1e-6)


def test_a_batch_without_signal_steps_on_its_shortest_sequence(model_dir: Path) -> None:
    """No step at all would leave AdamW's weights elsewhere: the optimizer steps on the zero
    gradient of one sequence, and the weights are those of the whole batch's step."""
    batch = sparse_batch()
    flat = batch.replace(advantages=tuple(m * 0.0 for m in batch.loss_mask))
    shortest = min(range(8), key=lambda i: flat.loss_mask[i].numel())
    assert sequences_with_signal(flat) == [shortest]
    assert sequences_with_signal(flat, [1, 2]) == [min((1, 2), key=lambda i:
                                                       flat.loss_mask[i].numel())]
    assert sequences_with_signal(flat, []) == []
    assert sequences_with_signal(batch) == [4, 5, 7]
    assert sequences_with_signal(batch, [0, 5, 6]) == [5]
    weights_plain, metrics_plain = one_step(model_dir, LossConfig.from_preset("grpo"), flat,
                                            weight_decay=0.1)
    weights_skip, metrics_skip = one_step(
        model_dir, LossConfig.from_preset("grpo", skip_zero_advantage=True), flat,
        weight_decay=0.1)
    assert (metrics_plain["num_micro_batches"], metrics_skip["num_micro_batches"]) == (8.0, 1.0)
    initial = TorchBackend(model_dir, TorchBackendConfig(device="cpu")).model
    moved = False
    for name, start in initial.named_parameters():
        assert torch.equal(weights_plain[name], weights_skip[name]), name
        moved = moved or not torch.equal(start.detach(), weights_skip[name])
    assert moved  # weight decay on a zero gradient: the step is not a no-op


def test_the_critic_never_skips() -> None:
    batch = sparse_batch()
    batch = batch.replace(returns=batch.advantages, old_values=batch.advantages)
    micro = loss_micro_batches(batch, LossConfig.from_preset("grpo", skip_zero_advantage=True),
                               critic=True, max_tokens=4096, pack=True)
    assert sorted(i for mb in micro for i in mb.indices) == list(range(8))


@pytest.mark.parametrize("settings", [
    {"entropy_coef": 0.01},
    {"kl_coef": 0.01, "kl_mode": "loss"},
    {"objective": "sft"},
])
def test_refused_where_zero_advantage_still_has_a_gradient(settings: dict[str, object]) -> None:
    with pytest.raises(ValidationError, match="skip_zero_advantage"):
        LossConfig(skip_zero_advantage=True, **settings)


def test_a_kl_in_the_reward_allows_it() -> None:
    loss = LossConfig(skip_zero_advantage=True, kl_coef=0.01, kl_mode="reward")
    assert loss.zero_advantage_adds_nothing

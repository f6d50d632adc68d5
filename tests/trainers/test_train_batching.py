"""TrainBatch validation/construction and token-balanced, packed micro-batches."""

from __future__ import annotations

import pytest
import torch

from palaestra.errors import ConfigError, TrajectoryValidationError
from palaestra.trainers.batching import TrainBatch, pad_ragged, unpad
from palaestra.trainers.micro_batches import (
    build_micro_batch,
    make_micro_batches,
    plan_micro_batches,
    split_across_ranks,
)
from palaestra.types import Sample

torch.set_num_threads(1)


def make_sample(n: int, prompt: int = 2, reward: float = 0.0, group: str = "g",
                advantage: float | None = None) -> Sample:
    return Sample(
        token_ids_T=tuple(range(10, 10 + n)), loss_mask_T=(0,) * prompt + (1,) * (n - prompt),
        logprobs_T=(0.0,) * prompt + (-0.5,) * (n - prompt), versions_T=(3,) * n,
        prompt_len=prompt, reward=reward, group_id=group, advantage=advantage,
    )


def test_from_samples_fields_and_scalar_advantages():
    batch = TrainBatch.from_samples([make_sample(4, advantage=2.0), make_sample(3, advantage=-1.0)])
    assert batch.lengths == [4, 3] and batch.num_tokens == 7 and batch.num_loss_tokens == 3
    assert batch.token_ids[0].dtype == torch.long and batch.loss_mask[0].dtype == torch.float32
    assert batch.advantages[0].tolist() == [0, 0, 2.0, 2.0]
    assert batch.advantages[1].tolist() == [0, 0, -1.0]
    assert batch.rollout_logprobs[1].tolist() == [0, 0, -0.5]
    assert batch.rewards.tolist() == [0.0, 0.0]
    # without advantages on every sample: none
    mixed = TrainBatch.from_samples([make_sample(4, advantage=2.0), make_sample(3)])
    assert mixed.advantages is None


def test_group_index_and_select_and_replace():
    batch = TrainBatch.from_samples([make_sample(3, group=g) for g in ("b", "a", "b", "", "")])
    assert batch.group_index().tolist() == [0, 1, 0, 2, 3]  # ungrouped samples stand alone
    sub = batch.select([2, 0])
    assert sub.group_ids == ("b", "b") and sub.lengths == [3, 3]
    rep = batch.replace(advantages=[[0, 0, 1.0]] * 5)
    assert rep.advantages[4].tolist() == [0, 0, 1.0] and batch.advantages is None


def test_validation_errors_say_what_to_fix():
    with pytest.raises(TrajectoryValidationError, match="first token"):
        TrainBatch(token_ids=[[1, 2]], loss_mask=[[1, 1]])
    with pytest.raises(TrajectoryValidationError, match="one value per token"):
        TrainBatch(token_ids=[[1, 2, 3]], loss_mask=[[0, 1]])
    with pytest.raises(TrajectoryValidationError, match="sequences"):
        TrainBatch(token_ids=[[1, 2]], loss_mask=[[0, 1]], advantages=[[0, 1], [0, 1]])
    with pytest.raises(TrajectoryValidationError, match="empty"):
        TrainBatch(token_ids=[[]], loss_mask=[[]])
    with pytest.raises(TrajectoryValidationError, match="chosen"):
        TrainBatch.from_pairs([make_sample(3)], [])


def test_pad_unpad_roundtrip():
    rows = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0])]
    padded = pad_ragged(rows, pad_value=-1)
    assert padded.tolist() == [[1, 2, 3], [4, -1, -1]]
    assert [r.tolist() for r in unpad(padded, [3, 1])] == [[1, 2, 3], [4]]


def test_plan_packed_bins_respect_budget():
    lengths = [5, 3, 8, 2, 7, 1]
    bins = plan_micro_batches(lengths, 10, pack=True)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 3  # 26 tokens in bins of 10: first-fit decreasing reaches the minimum
    assert plan_micro_batches(lengths, 10, pack=True) == bins  # deterministic


def test_plan_padded_bins_count_padding():
    lengths = [5, 3, 8, 2, 7, 1]
    bins = plan_micro_batches(lengths, 16, pack=False)
    assert sorted(i for b in bins for i in b) == list(range(6))
    for b in bins:
        assert len(b) * max(lengths[i] for i in b) <= 16 or len(b) == 1
    # an over-long sequence gets a micro-batch of its own instead of failing
    assert plan_micro_batches([20, 3], 10, pack=True) == [[0], [1]]
    with pytest.raises(ConfigError):
        plan_micro_batches([1], 0)


def test_pairs_stay_together():
    units = [[0, 1], [2, 3], [4, 5]]
    lengths = [4, 4, 3, 3, 5, 5]
    for pack in (True, False):
        for b in plan_micro_batches(lengths, 9, pack=pack, units=units):
            for u in units:
                assert set(u) <= set(b) or not set(u) & set(b)
    parts = split_across_ranks(lengths, 2, units=units)
    for part in parts:
        for u in units:
            assert set(u) <= set(part) or not set(u) & set(part)


def test_split_across_ranks_is_near_even_on_many_sequences():
    """LPT over 200 random lengths: every sequence once, ranks within the largest sequence of
    each other, and more even than striding the batch over the ranks."""
    import random

    rng = random.Random(0)
    lengths = [rng.randint(8, 400) for _ in range(200)]
    parts = split_across_ranks(lengths, 8)
    assert sorted(i for p in parts for i in p) == list(range(200))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= 400
    naive = [sum(lengths[i::8]) for i in range(8)]
    assert max(loads) - min(loads) < max(naive) - min(naive)
    assert split_across_ranks([], 3) == [[], [], []]


def test_split_across_ranks_balances_tokens():
    lengths = [10, 9, 8, 7, 6, 5, 4, 3]
    parts = split_across_ranks(lengths, 2)
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert sorted(i for p in parts for i in p) == list(range(8))
    assert abs(loads[0] - loads[1]) <= 2


def test_build_packed_micro_batch_positions_and_unpack():
    ids = [torch.tensor([5, 6, 7]), torch.tensor([8, 9]), torch.tensor([1, 2, 3, 4])]
    adv = [torch.tensor([0.0, 1.0, 2.0]), torch.tensor([0.0, 3.0]), torch.tensor([0.0, 4, 5, 6])]
    mb = build_micro_batch(ids, [0, 2], pack=True, fields={"advantages": adv})
    assert mb.input_ids.tolist() == [[5, 6, 7, 1, 2, 3, 4]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    assert mb.seq_index.tolist() == [[0, 0, 0, 1, 1, 1, 1]]
    assert mb.attention_mask is None
    assert mb.fields["advantages"].tolist() == [[0, 1, 2, 0, 4, 5, 6]]
    assert [t.tolist() for t in mb.unpack(mb.fields["advantages"])] == [[0, 1, 2], [0, 4, 5, 6]]

    padded = build_micro_batch(ids, [1, 2], pack=False, fields={"advantages": adv})
    assert padded.input_ids.tolist() == [[8, 9, 0, 0], [1, 2, 3, 4]]
    assert padded.attention_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert padded.seq_index.tolist() == [[0, 0, -1, -1], [1, 1, 1, 1]]
    unpacked = [t.tolist() for t in padded.unpack(padded.fields["advantages"])]
    assert unpacked == [[0, 3], [0, 4, 5, 6]]


def test_make_micro_batches_cover_the_batch_once():
    batch = TrainBatch.from_samples([make_sample(n) for n in (9, 4, 6, 3, 8, 5)])
    for pack in (True, False):
        micro = make_micro_batches(batch, 12, pack=pack)
        seen = sorted(i for mb in micro for i in mb.indices)
        assert seen == list(range(6))
        for mb in micro:
            for i, ids in zip(mb.indices, mb.unpack(mb.input_ids)):
                assert ids.tolist() == batch.token_ids[i].tolist()
            assert set(mb.fields) == {"loss_mask", "rollout_logprobs"}
    sub = make_micro_batches(batch, 100, subset=[1, 3])
    assert [mb.indices for mb in sub] == [[1, 3]]

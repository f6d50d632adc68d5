"""Group filters, the failure policy, and samples -> balanced shards, micro-batches, tensors."""

from __future__ import annotations

import random

import pytest

from palaestra.errors import ConfigError
from palaestra.rollout import balance_by_tokens, collate, judge_group, micro_batches
from palaestra.rollout.groups import resolve_filters
from palaestra.types import Sample, StopReason, Trajectory


def sample(n: int, reward: float = 0.0, group: str = "g") -> Sample:
    mask = tuple([0] * (n // 2) + [1] * (n - n // 2))
    return Sample(tuple(range(n)), mask, tuple(-0.5 * m for m in mask),
                  tuple(2 if m else -1 for m in mask), n // 2, reward=reward, group_id=group)


def traj(reward: float, stop=StopReason.TERMINATED, error=None) -> Trajectory:
    return Trajectory("env", "t", (), (), (sample(4, reward),), reward, stop, error)


def test_filters_and_failure_policy():
    filters = resolve_filters(["nonzero_variance"])
    assert judge_group([traj(1), traj(0)], filters).status == "kept"
    verdict = judge_group([traj(1), traj(1)], filters)
    assert verdict.status == "filtered" and verdict.reason == "nonzero_variance"
    failed = traj(0, StopReason.ERROR, "env.step: boom")
    mixed = judge_group([traj(1), traj(0), failed], filters)
    assert mixed.status == "kept" and len(mixed.usable) == 2  # failed episodes never train
    lost = judge_group([traj(1), failed, failed], filters, min_group_size=2)
    assert lost.status == "failed" and "boom" in lost.reason
    custom = resolve_filters([lambda ts: len(ts) > 5])
    assert judge_group([traj(1), traj(0)], custom).status == "filtered"
    with pytest.raises(ConfigError, match="unknown group filter"):
        resolve_filters(["nope"])


def test_balance_by_tokens_is_near_even():
    rng = random.Random(0)
    samples = [sample(rng.randint(8, 400), group=f"g{i}") for i in range(200)]
    shards = balance_by_tokens(samples, 8)
    assert sorted(id(s) for sh in shards for s in sh) == sorted(id(s) for s in samples)
    loads = [sum(s.num_tokens for s in sh) for sh in shards]
    assert max(loads) - min(loads) <= 400  # LPT: within the largest sample
    naive = [sum(s.num_tokens for s in samples[i::8]) for i in range(8)]
    assert max(loads) - min(loads) < max(naive) - min(naive)
    assert balance_by_tokens([], 3) == [[], [], []]
    with pytest.raises(ConfigError):
        balance_by_tokens(samples, 0)


def test_micro_batches_same_count_per_rank():
    rng = random.Random(1)
    samples = [sample(rng.randint(10, 300)) for _ in range(64)]
    ranks = micro_batches(samples, 4, max_tokens=1024)
    counts = {len(r) for r in ranks}
    assert len(counts) == 1
    for rank in ranks:
        for mb in rank:
            assert sum(s.num_tokens for s in mb) <= 1024 or len(mb) == 1
    assert sum(len(mb) for r in ranks for mb in r) == 64


def test_collate_pads_and_keeps_values():
    a, b = sample(6, 1.0), sample(3, 0.0).with_advantage(0.5)
    batch = collate([a, b], pad_id=99)
    assert batch["input_ids"].shape == (2, 6)
    assert batch["input_ids"][1].tolist() == [0, 1, 2, 99, 99, 99]
    assert batch["attention_mask"][1].tolist() == [1, 1, 1, 0, 0, 0]
    assert batch["loss_mask"][0].tolist() == list(a.loss_mask_T)
    assert batch["rollout_logprobs"][0].tolist() == list(a.logprobs_T)
    assert batch["versions"][1].tolist() == [-1, 2, 2, -1, -1, -1]
    assert batch["rewards"].tolist() == [1.0, 0.0]
    adv = batch["advantages"].tolist()
    assert adv[1] == 0.5 and adv[0] != adv[0]  # NaN where unset

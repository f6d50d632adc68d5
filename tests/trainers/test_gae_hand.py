"""GAE advantages and returns as the PPO step computes them, against a case worked by hand.

Two samples: a two-turn episode whose tool output (two tokens) sits between the assistant turns
and is masked, with a reward per turn (``use_turn_rewards``), and a one-turn episode. The values
under masked tokens are 9.0: were they read, every number below would change.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from palaestra.trainers.algorithms.config import LossConfig
from palaestra.trainers.algorithms.estimators import compute_advantages
from palaestra.trainers.batching import TrainBatch
from palaestra.trainers.ppo.step import mini_batches, value_stats

GAMMA, LAM = 0.9, 0.8

# sample 0: [prompt, prompt, a, a, tool, tool, a, a]; turn 1 = tokens [0, 4), turn 2 = [4, 8)
MASK0 = [0, 0, 1, 1, 0, 0, 1, 1]
VALUES0 = [0.0, 9.0, 0.2, 0.3, 9.0, 9.0, 0.4, 0.6]
# sample 1: [prompt, a, a, a], one turn
MASK1 = [0, 1, 1, 1]
VALUES1 = [0.0, 0.5, 0.2, -0.1]

# By hand, over the sampled tokens only (the tool tokens neither discount nor break the chain),
# delta_t = r_t + GAMMA V_next - V_t, A_t = delta_t + GAMMA LAM A_next, R_t = A_t + V_t:
# sample 0, turn rewards 0.5 (on token 3) and 1.0 (on token 7):
#   t=7: delta = 1.0 - 0.6 = 0.4                        A = 0.4
#   t=6: delta = 0.9 * 0.6 - 0.4 = 0.14                 A = 0.14 + 0.72 * 0.4 = 0.428
#   t=3: delta = 0.5 + 0.9 * 0.4 - 0.3 = 0.56           A = 0.56 + 0.72 * 0.428 = 0.86816
#   t=2: delta = 0.9 * 0.3 - 0.2 = 0.07                 A = 0.07 + 0.72 * 0.86816 = 0.6950752
# sample 1, turn reward -1.0 (on token 3):
#   t=3: delta = -1.0 + 0.1 = -0.9                      A = -0.9
#   t=2: delta = 0.9 * -0.1 - 0.2 = -0.29               A = -0.29 - 0.72 * 0.9 = -0.938
#   t=1: delta = 0.9 * 0.2 - 0.5 = -0.32                A = -0.32 - 0.72 * 0.938 = -0.99536
ADV0 = [0.0, 0.0, 0.6950752, 0.86816, 0.0, 0.0, 0.428, 0.4]
ADV1 = [0.0, -0.99536, -0.938, -0.9]
RET0 = [0.0, 0.0, 0.8950752, 1.16816, 0.0, 0.0, 0.828, 1.0]
RET1 = [0.0, -0.49536, -0.738, -1.0]


def _batch() -> TrainBatch:
    return TrainBatch(
        token_ids=[list(range(8)), list(range(4))],
        loss_mask=[MASK0, MASK1],
        rewards=torch.tensor([1.5, -1.0]),
        turn_rewards=((0.5, 1.0), (-1.0,)),
        turn_ends=((4, 8), (4,)),
    )


def _ppo(**kw) -> LossConfig:
    return LossConfig(preset="ppo", gamma=GAMMA, gae_lambda=LAM, **kw)


def test_gae_returns_and_whitened_advantages_equal_the_hand_computation():
    out = compute_advantages(_batch(), _ppo(use_turn_rewards=True),
                             values=[torch.tensor(VALUES0), torch.tensor(VALUES1)])
    assert out.returns[0].tolist() == pytest.approx(RET0, abs=1e-6)
    assert out.returns[1].tolist() == pytest.approx(RET1, abs=1e-6)
    raw = [a for a, m in zip(ADV0 + ADV1, MASK0 + MASK1) if m]
    mean, std = statistics.mean(raw), statistics.stdev(raw)  # whitened over the batch's tokens
    want0 = [(a - mean) / std if m else 0.0 for a, m in zip(ADV0, MASK0)]
    want1 = [(a - mean) / std if m else 0.0 for a, m in zip(ADV1, MASK1)]
    assert out.advantages[0].tolist() == pytest.approx(want0, abs=1e-5)
    assert out.advantages[1].tolist() == pytest.approx(want1, abs=1e-5)
    assert out.old_values[0].tolist() == pytest.approx(VALUES0)  # the values GAE used


def test_outcome_reward_goes_on_the_last_sampled_token():
    """Without per-turn rewards sample 0's 1.5 sits on token 7: t=7 A = 1.5 - 0.6 = 0.9,
    t=6 A = 0.14 + 0.72 * 0.9 = 0.788, t=3 A = 0.9*0.4 - 0.3 + 0.72 * 0.788 = 0.62736."""
    out = compute_advantages(_batch(), _ppo(),
                             values=[torch.tensor(VALUES0), torch.tensor(VALUES1)])
    assert out.returns[0].tolist()[3:] == pytest.approx(
        [0.92736, 0.0, 0.0, 1.188, 1.5], abs=1e-6)


def test_value_stats_explained_variance_by_hand():
    batch = TrainBatch(token_ids=[[0, 1, 2, 3]], loss_mask=[[0, 1, 1, 1]],
                       old_values=[[9.0, 0.0, 1.0, 2.0]], returns=[[5.0, 0.0, 2.0, 2.0]])
    stats = value_stats(batch)
    # R - V over the sampled tokens = [0, 1, 0]: Var = 1/3; Var(R) = 4/3 -> 1 - 1/4
    assert stats["ppo/explained_variance"] == pytest.approx(0.75)
    assert stats["ppo/value_mean"] == pytest.approx(1.0)
    assert stats["ppo/return_mean"] == pytest.approx(4 / 3)
    assert stats["ppo/advantage_max"] == pytest.approx(1.0)


def test_mini_batches_cover_the_batch_once_per_epoch_and_depend_on_the_step_only():
    plans = [mini_batches(10, 4, seed=0, step=3, epoch=e) for e in range(2)]
    for plan in plans:
        assert [len(p) for p in plan] == [4, 4, 2]
        assert sorted(i for p in plan for i in p) == list(range(10))
    assert plans[0] != plans[1]  # each epoch reshuffles
    assert mini_batches(10, 4, seed=0, step=3, epoch=0) == plans[0]  # a resumed run agrees
    assert mini_batches(10, None, seed=0, step=3, epoch=0) == [list(range(10))]

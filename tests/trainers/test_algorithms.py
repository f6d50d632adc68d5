"""Advantage estimators, policy/value/KL/SFT/DPO losses and aggregation vs hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from palaestra.trainers.algorithms import advantages as A
from palaestra.trainers.algorithms.aggregation import aggregate_loss, loss_token_weights
from palaestra.trainers.algorithms.kl import kl_estimate, kl_penalty_rewards
from palaestra.trainers.algorithms.policy_loss import (
    gspo_loss,
    ppo_clip_loss,
    sequence_mean,
    tis_weights,
)
from palaestra.trainers.algorithms.supervised import dpo_loss, sft_loss
from palaestra.trainers.algorithms.value_loss import clipped_value_loss

torch.set_num_threads(1)


def close(actual: torch.Tensor, expected: list[float] | float, atol: float = 1e-5) -> None:
    torch.testing.assert_close(
        actual.to(torch.float64), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=0
    )


# ------------------------------------------------------------------------------ advantages
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 5.0])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 2])


def test_grpo_group_mean_and_unbiased_std():
    # group 0: mean 0.5, std = sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.866025
    # group 1: std 0 -> 0 ; group 2 (alone): 0
    s = 0.5 / math.sqrt(1 / 3)
    close(A.grpo_advantages(REWARDS, GROUPS), [s, -s, -s, s, 0, 0, 0], atol=1e-4)


def test_dr_grpo_only_centres():
    close(A.dr_grpo_advantages(REWARDS, GROUPS), [0.5, -0.5, -0.5, 0.5, 0, 0, 0])
    close(A.grpo_advantages(REWARDS, GROUPS, norm_by_std=False), [0.5, -0.5, -0.5, 0.5, 0, 0, 0])


def test_rloo_leave_one_out_baseline():
    # r0=1, others (0, 0, 1) -> 1 - 1/3 ; r1=0, others (1, 0, 1) -> -2/3
    close(A.rloo_advantages(REWARDS, GROUPS), [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0])


def test_group_index_from_ids_in_order_of_appearance():
    assert A.group_index_from_ids(["b", "a", "b", "c"]).tolist() == [0, 1, 0, 2]


def test_masked_whiten_unbiased():
    close(A.masked_whiten(torch.tensor([1.0, 2.0, 3.0, 50.0]), torch.tensor([1, 1, 1, 0])),
          [-1.0, 0.0, 1.0, 0.0])


def test_discounted_returns_skip_unsampled_tokens():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    mask = torch.tensor([[1, 0, 1, 1]])
    close(A.discounted_returns(rewards, mask, gamma=0.5), [[0.25, 0.0, 0.5, 1.0]])


def test_outcome_reward_on_last_sampled_token():
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]])
    close(A.outcome_token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask),
          [[0, 0, 2, 0], [0, 3, 0, 0], [0, 0, 0, 0]])


def test_gae_hand_computed_and_masked_gap():
    # delta2 = 1 - 0.7 = 0.3 ; delta1 = 0.9*0.7 - 0.6 = 0.03 ; delta0 = 0.9*0.6 - 0.5 = 0.04
    # A2 = 0.3 ; A1 = 0.03 + 0.72*0.3 = 0.246 ; A0 = 0.04 + 0.72*0.246 = 0.21712
    adv, ret = A.gae_advantages(
        torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]]),
        torch.tensor([[1, 1, 1]]), gamma=0.9, lam=0.8,
    )
    close(adv, [[0.21712, 0.246, 0.3]])
    close(ret, [[0.71712, 0.846, 1.0]])
    # a tool-output token (mask 0) in between is skipped: same numbers on the sampled tokens
    adv, ret = A.gae_advantages(
        torch.tensor([[0.0, 0.0, 0.0, 1.0]]), torch.tensor([[0.5, 9.9, 0.6, 0.7]]),
        torch.tensor([[1, 0, 1, 1]]), gamma=0.9, lam=0.8,
    )
    close(adv, [[0.21712, 0.0, 0.246, 0.3]])
    close(ret, [[0.71712, 0.0, 0.846, 1.0]])


def test_reinforce_pp_whitened_returns():
    mask = torch.tensor([[0, 1, 1], [0, 1, 1]])
    token_rewards = A.outcome_token_rewards(torch.tensor([1.0, 0.0]), mask)
    # returns on sampled tokens: [1, 1, 0, 0] -> mean 0.5, std sqrt(1/3)
    s = 0.5 / math.sqrt(1 / 3)
    close(A.reinforce_pp_advantages(token_rewards, mask), [[0, s, s], [0, -s, -s]], atol=1e-4)


def test_reinforce_pp_baseline_with_token_penalty():
    # centred rewards [0.5, -0.5]; penalty -0.1 on token (0, 1)
    # returns [0.4, 0.5, -0.5, -0.5]: mean -0.025, unbiased std 0.55
    mask = torch.tensor([[0, 1, 1], [0, 1, 1]])
    penalty = torch.tensor([[0.0, -0.1, 0.0], [0.0, 0.0, 0.0]])
    adv = A.reinforce_pp_baseline_advantages(
        torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask, token_penalty_BT=penalty
    )
    close(adv, [[0, 0.425 / 0.55, 0.525 / 0.55], [0, -0.475 / 0.55, -0.475 / 0.55]])


def test_turn_returns_mapped_to_tokens():
    assert A.turn_returns([1.0, 0.0, 2.0], gamma=0.5) == [1.5, 1.0, 2.0]
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 0, 1])
    close(A.turn_returns_to_tokens([1.0, 0.0, 2.0], [3, 6, 8], mask, gamma=0.5),
          [0, 1.5, 1.5, 0, 1.0, 1.0, 0, 2.0])
    close(A.turn_token_rewards([1.0, 0.0, 2.0], [3, 6, 8], mask), [0, 0, 1, 0, 0, 0, 0, 2])
    with pytest.raises(ValueError, match="turn ends"):
        A.turn_returns_to_tokens([1.0], [3, 6], mask)


# --------------------------------------------------------------------------- policy losses
def test_ppo_clip_higher_and_dual_clip():
    old = torch.zeros(4)
    logp = torch.tensor([0.5, -0.5, -0.5, 1.5], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    r = [math.exp(0.5), math.exp(-0.5), math.exp(-0.5), math.exp(1.5)]
    out = ppo_clip_loss(logp, old, adv, eps_low=0.2, eps_high=0.2)
    # a: clipped at 1.2 ; b: unclipped ; c: clipped at 0.8 (A<0) ; d: unclipped (A<0, large)
    close(out.loss, [-1.2, -r[1], 0.8, r[3]])
    close(out.stats["clip_frac"], [1, 0, 1, 0])
    close(out.stats["clip_frac_high"], [1, 0, 0, 0])
    close(out.stats["clip_frac_low"], [0, 0, 1, 0])
    out.loss.sum().backward()
    close(logp.grad, [0.0, -r[1], 0.0, r[3]])  # clipped tokens carry no gradient

    higher = ppo_clip_loss(logp.detach(), old, adv, eps_low=0.2, eps_high=0.28)
    close(higher.loss[0], -1.28)
    dual = ppo_clip_loss(logp.detach(), old, adv, eps_low=0.2, eps_high=0.2, dual_clip_c=3.0)
    close(dual.loss, [-1.2, -r[1], 0.8, 3.0])  # d bounded by c * |A| = 3
    close(dual.stats["dual_clip_frac"], [0, 0, 0, 1])


def test_gspo_sequence_ratio_value_and_gradient():
    old = torch.zeros(2, 2)
    logp = torch.tensor([[0.1, 0.3], [-0.1, -0.1]], requires_grad=True)
    adv = torch.ones(2, 2)
    mask = torch.ones(2, 2)
    out = gspo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    # seq 0: s = exp(0.2) = 1.2214 > 1.2 -> clipped ; seq 1: s = exp(-0.1) = 0.904837 inside
    s1 = math.exp(-0.1)
    close(out.loss, [[-1.2, -1.2], [-s1, -s1]])
    close(out.stats["ratio"], [[math.exp(0.2)] * 2, [s1] * 2])
    out.loss.sum().backward()
    close(logp.grad, [[0.0, 0.0], [-s1, -s1]])  # d s_{i,t} / d logp_t = s_i


def test_gspo_packed_equals_rows():
    logp = torch.tensor([[0.1, 0.3], [-0.1, -0.2]])
    packed = logp.reshape(1, 4)
    seq_index = torch.tensor([[0, 0, 1, 1]])
    close(sequence_mean(packed, torch.ones(1, 4), seq_index).reshape(2, 2),
          sequence_mean(logp, torch.ones(2, 2)).tolist())
    rows = gspo_loss(logp, torch.zeros(2, 2), torch.ones(2, 2), torch.ones(2, 2))
    one = gspo_loss(packed, torch.zeros(1, 4), torch.ones(1, 4), torch.ones(1, 4),
                    seq_index=seq_index)
    close(one.loss.reshape(2, 2), rows.loss.tolist())


def test_tis_weights_truncated():
    close(tis_weights(torch.tensor([-1.0, -1.5]), torch.tensor([-1.5, -1.0]), cap=1.5),
          [1.5, math.exp(-0.5)])


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    close(kl_estimate(logp, ref, "k1"), [0.5])
    close(kl_estimate(logp, ref, "k2"), [0.125])
    close(kl_estimate(logp, ref, "k3"), [math.exp(-0.5) - 0.5])
    close(kl_estimate(ref, ref, "k3"), [0.0])
    with pytest.raises(ValueError, match="k1"):
        kl_estimate(logp, ref, "k4")
    pen = kl_penalty_rewards(torch.tensor([0.0, 1.0]), torch.tensor([-1.0, -1.0]),
                             torch.tensor([-1.5, -1.0]), torch.tensor([1, 1]), kl_coef=0.1)
    close(pen, [-0.05, 1.0])


# ------------------------------------------------------------------------------ aggregation
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
LOSS = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0], [100.0] * 4])


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected"),
    [
        ("token-mean", {}, 2.5),  # (1+2+3+4)/4
        ("seq-mean-token-sum", {}, 5.0),  # (6+4)/2, the empty row does not count
        ("seq-mean-token-mean", {}, 3.0),  # (2+4)/2
        ("seq-mean-token-sum-norm", {}, 10 / 6),  # (6+4)/(2*3), L = longest = 3
        ("seq-mean-token-sum-norm", {"norm_len": 4}, 1.25),  # (6+4)/(2*4)
    ],
)
def test_loss_aggregation(mode, kwargs, expected):
    close(aggregate_loss(LOSS, MASK, mode, **kwargs), expected)


def test_group_mean_token_mean():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]])
    loss = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [5.0, 7.0, 9.0, 9.0]])
    # group 0 = rows 0,1: (1+2+3+4)/4 = 2.5 ; group 1 = row 2: 6 -> mean 4.25
    close(aggregate_loss(loss, mask, "group-mean-token-mean",
                         group_index_B=torch.tensor([0, 0, 1])), 4.25)
    with pytest.raises(ValueError, match="group"):
        loss_token_weights(mask, "group-mean-token-mean")


# ------------------------------------------------------------------- value, SFT, DPO losses
def test_clipped_value_loss():
    values = torch.tensor([1.0, 1.0, 0.0])
    old = torch.tensor([0.5, 0.9, 0.5])
    returns = torch.tensor([2.0, 0.0, 0.0])
    out = clipped_value_loss(values, old, returns, clip=0.2)
    # (1) clipped V = 0.7: max(1, 1.69)/2 ; (2) inside the clip: 1/2 ; (3) clipped V = 0.3: 0.09/2
    close(out.loss, [0.845, 0.5, 0.045])
    close(out.stats["value_clip_frac"], [1, 0, 1])
    close(clipped_value_loss(values, old, returns, clip=None).loss, [0.5, 0.5, 0.0])


def test_sft_masked_nll():
    logp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -3.0, -7.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    close(sft_loss(logp, mask), 2.0)  # (1+2+3)/3
    close(sft_loss(logp, mask, "seq-mean-token-mean"), 2.25)  # (1.5 + 3)/2


def test_dpo_loss_and_label_smoothing():
    pc, pr = torch.tensor([-10.0]), torch.tensor([-12.0])
    rc, rr = torch.tensor([-11.0]), torch.tensor([-11.0])
    # h = 0.5 * ((-10 + 11) - (-12 + 11)) = 1 -> -log sigmoid(1) = log(1 + e^-1)
    out = dpo_loss(pc, pr, rc, rr, beta=0.5)
    close(out.loss, [math.log1p(math.exp(-1))])
    close(out.stats["dpo_reward_margin"], [1.0])
    close(out.stats["dpo_reward_accuracy"], [1.0])
    smooth = dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.1)
    close(smooth.loss, [0.9 * math.log1p(math.exp(-1)) + 0.1 * math.log1p(math.exp(1))])

"""LossConfig, compute_advantages (samples -> token advantages) and the micro-batch RL loss."""

from __future__ import annotations

import math
import sys

import pydantic
import pytest
import tomllib
import torch

from palaestra.errors import ConfigError
from palaestra.trainers.algorithms.config import PRESETS, LossConfig
from palaestra.trainers.algorithms.estimators import compute_advantages
from palaestra.trainers.algorithms.objective import rl_loss, sequence_sums
from palaestra.trainers.batching import TrainBatch
from palaestra.types import Sample

torch.set_num_threads(1)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0,
    )


def sample(mask, reward=0.0, group="g", turn_rewards=(), turn_ends=(), logprobs=None):
    n = len(mask)
    return Sample(
        token_ids_T=tuple(range(1, n + 1)), loss_mask_T=tuple(mask),
        logprobs_T=tuple(logprobs or [0.0] * n), versions_T=(0,) * n,
        prompt_len=1, reward=reward, group_id=group,
        turn_rewards=tuple(turn_rewards), turn_ends=tuple(turn_ends),
    )


# ------------------------------------------------------------------------------ LossConfig
def test_loss_config_from_toml_with_preset_and_override():
    data = tomllib.loads('preset = "gspo"\nkl_coef = 0.01\nclip_eps_high = 5e-4\n')
    cfg = LossConfig(**data)
    assert cfg.policy_loss == "gspo" and cfg.clip_eps_low == 3e-4 and cfg.clip_eps_high == 5e-4
    assert cfg.kl_coef == 0.01 and cfg.needs_ref_logprobs
    assert LossConfig.from_preset("dr_grpo").loss_agg == "seq-mean-token-sum-norm"
    assert LossConfig.from_preset("ppo").needs_values
    for name in PRESETS:
        LossConfig.from_preset(name)


def test_loss_config_reports_every_problem_at_once():
    with pytest.raises(pydantic.ValidationError) as err:
        LossConfig(klcoef=1.0, dual_clip_c=0.5, loss_agg="mean")
    text = str(err.value)
    assert "klcoef" in text and "dual_clip_c" in text and "loss_agg" in text
    with pytest.raises(pydantic.ValidationError, match="unknown loss preset"):
        LossConfig(preset="grpo2")


def test_config_module_imports_no_torch():
    import subprocess

    code = ("import sys; import palaestra.trainers.algorithms.config, "
            "palaestra.trainers.torch_backend.config; "
            "from palaestra.trainers.algorithms.config import LossConfig; "
            "from palaestra.trainers.torch_backend.config import TorchBackendConfig; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------- compute_advantages
def test_grpo_advantages_on_loss_tokens_only():
    batch = TrainBatch.from_samples([
        sample([0, 1, 1], 1.0), sample([0, 0, 1], 0.0), sample([0, 1, 1], 0.0),
        sample([0, 1, 1], 1.0),
    ])
    out = compute_advantages(batch, LossConfig.from_preset("grpo"))
    s = 0.5 / math.sqrt(1 / 3)
    close(torch.stack(out.advantages), [[0, s, s], [0, 0, -s], [0, -s, -s], [0, s, s]], atol=1e-4)


def test_per_turn_returns_with_group_baseline():
    cfg = LossConfig.from_preset("dr_grpo", use_turn_rewards=True)
    batch = TrainBatch.from_samples([
        sample([0, 1, 1, 0, 1], 1.0, turn_rewards=[1.0, 0.0], turn_ends=[3, 5]),
        sample([0, 1, 1, 0, 1], 0.0, turn_rewards=[0.0, 0.0], turn_ends=[3, 5]),
    ])
    out = compute_advantages(batch, cfg)
    # G_0 = (1, 0): baseline 0.5 ; sample 0 turn 0 gets 1 - 0.5, turn 1 gets 0 - 0.5
    close(out.advantages[0], [0, 0.5, 0.5, 0, -0.5])
    close(out.advantages[1], [0, -0.5, -0.5, 0, -0.5])


def test_gae_returns_and_whitened_advantages():
    batch = TrainBatch.from_samples([sample([0, 1, 1, 1], 1.0)])
    cfg = LossConfig.from_preset("ppo", gamma=0.9, gae_lambda=0.8)
    with pytest.raises(ConfigError, match="critic"):
        compute_advantages(batch, cfg)
    out = compute_advantages(batch, cfg, values=[torch.tensor([0.0, 0.5, 0.6, 0.7])])
    close(out.returns[0], [0, 0.71712, 0.846, 1.0])
    raw = torch.tensor([0.21712, 0.246, 0.3])
    close(out.advantages[0][1:], (raw - raw.mean()) / (raw.std() + 1e-8))
    close(out.old_values[0], [0.0, 0.5, 0.6, 0.7])


def test_reinforce_pp_with_kl_in_reward():
    cfg = LossConfig.from_preset("reinforce_pp", kl_coef=0.2)  # k1 in the reward
    batch = TrainBatch.from_samples([
        sample([0, 1, 1], 1.0, logprobs=[0.0, -1.0, -1.0]),
        sample([0, 1, 1], 0.0, logprobs=[0.0, -1.0, -1.0]),
    ])
    with pytest.raises(ConfigError, match="ref_logprobs"):
        compute_advantages(batch, cfg)
    batch = batch.replace(ref_logprobs=[[0.0, -1.5, -1.0], [0.0, -1.0, -1.0]])
    out = compute_advantages(batch, cfg)
    # token rewards [0, -0.1, 1] and [0, 0, 0] -> returns [0.9, 1.0, 0, 0] -> mean .475, std .55
    close(torch.stack(out.advantages),
          [[0, 0.425 / 0.55, 0.525 / 0.55], [0, -0.475 / 0.55, -0.475 / 0.55]])


def test_group_estimators_need_group_ids():
    batch = TrainBatch.from_samples([sample([0, 1], 1.0, group=""), sample([0, 1], 0.0, group="")])
    with pytest.raises(ConfigError, match="group_id"):
        compute_advantages(batch, LossConfig.from_preset("grpo"))
    out = compute_advantages(batch, LossConfig.from_preset("reinforce_pp"))
    assert out.advantages is not None


def test_rloo_matches_leave_one_out():
    batch = TrainBatch.from_samples([sample([0, 1], r) for r in (1.0, 0.0, 0.0, 1.0)])
    out = compute_advantages(batch, LossConfig.from_preset("rloo"))
    close(torch.stack(out.advantages)[:, 1], [2 / 3, -2 / 3, -2 / 3, 2 / 3])


# --------------------------------------------------------------------------- rl_loss (micro)
def test_rl_loss_combines_pg_kl_entropy_by_hand():
    cfg = LossConfig(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss, metrics = rl_loss(
        cfg, logp=logp, weights=torch.tensor([0.5, 0.5]), loss_mask=torch.ones(2),
        advantages=torch.tensor([1.0, -1.0]), ref_logp=torch.tensor([-1.5, -2.0]),
        entropy=torch.tensor([1.0, 2.0]),
    )
    k3 = math.exp(-0.5) - 0.5
    # pg: 0.5 * (-1) + 0.5 * (+1) = 0 ; kl: 0.5 * k3 ; entropy: 0.5 * 1 + 0.5 * 2
    close(loss.detach(), 0.1 * 0.5 * k3 - 0.01 * 1.5)
    close(metrics["actor/kl"], 0.5 * k3)
    close(metrics["actor/entropy"], 1.5)
    loss.backward()
    # d/dlogp0 = 0.5 * (-A0) + 0.1 * 0.5 * (1 - exp(-0.5)) ; d/dlogp1 = 0.5 * (-A1)
    close(logp.grad, [-0.5 + 0.05 * (1 - math.exp(-0.5)), 0.5])


def test_rl_loss_truncated_importance_sampling():
    cfg = LossConfig(tis_cap=1.2)
    logp = torch.tensor([-1.0, -2.0])
    loss, metrics = rl_loss(
        cfg, logp=logp, weights=torch.tensor([0.5, 0.5]), loss_mask=torch.ones(2),
        advantages=torch.tensor([1.0, -1.0]), rollout_logp=torch.tensor([-1.5, -2.0]),
    )
    # tis = [min(e^0.5, 1.2), 1] -> 0.5 * (-1 * 1.2) + 0.5 * (1 * 1)
    close(loss, -0.1)
    close(metrics["actor/tis_weight"], 0.5 * 1.2 + 0.5)
    with pytest.raises(ConfigError, match="rollout_logprobs"):
        rl_loss(cfg, logp=logp, weights=torch.ones(2), loss_mask=torch.ones(2),
                advantages=torch.ones(2))
    with pytest.raises(ConfigError, match="reference"):
        rl_loss(LossConfig(kl_coef=0.1), logp=logp, weights=torch.ones(2),
                loss_mask=torch.ones(2), advantages=torch.ones(2))


def test_rl_loss_gspo_uses_sequence_index():
    cfg = LossConfig.from_preset("gspo")
    logp = torch.tensor([[-1.0, -1.1, -0.5, -0.6]])
    old = torch.tensor([[-1.0, -1.0, -0.5, -0.5]])
    seq_index = torch.tensor([[0, 0, 1, 1]])
    _, metrics = rl_loss(
        cfg, logp=logp, old_logp=old, weights=torch.full((1, 4), 0.25),
        loss_mask=torch.ones(1, 4), advantages=torch.ones(1, 4), seq_index=seq_index,
    )
    close(metrics["actor/ratio"], math.exp(-0.05))  # both sequences: exp(mean(-0.0, -0.1))
    close(sequence_sums(logp, torch.ones(1, 4), seq_index), [-2.1, -1.1])


def _plain_batch(lengths, **fields):
    ids = [torch.arange(n) for n in lengths]
    masks = [torch.cat([torch.zeros(1), torch.ones(n - 1)]) for n in lengths]
    return TrainBatch(token_ids=ids, loss_mask=masks, **fields)


def test_check_train_batch_names_what_each_objective_lacks():
    from palaestra.trainers.algorithms.objective import check_train_batch

    batch = _plain_batch([3, 5])
    with pytest.raises(ConfigError, match=r"train_step\(rl\) needs \['advantages'\]"):
        check_train_batch(batch, LossConfig(preset="grpo"))
    with pytest.raises(ConfigError, match=r"train_step\(critic\) needs \['returns', 'old_values'\]"):
        check_train_batch(batch, LossConfig(), critic=True)
    with pytest.raises(ConfigError, match="paired"):
        check_train_batch(batch, LossConfig(preset="dpo"))
    paired = _plain_batch([3, 5], paired=True)
    with pytest.raises(ConfigError, match=r"needs \['ref_logprobs'\]"):
        check_train_batch(paired, LossConfig(preset="dpo"))
    check_train_batch(batch, LossConfig(preset="sft"))  # SFT reads nothing beyond the mask
    check_train_batch(batch.replace(advantages=[torch.zeros(3), torch.zeros(5)]),
                      LossConfig(preset="grpo"))


def test_dpo_pairs_share_the_loss_and_aggregate_token_mean():
    from palaestra.trainers.algorithms.objective import (
        PAIR_WEIGHT,
        batch_loss_weights,
        sequence_fields,
    )

    dpo = LossConfig(preset="dpo").model_copy(update={"loss_agg": "seq-mean-token-sum"})
    fields = sequence_fields(4, dpo)
    assert fields[PAIR_WEIGHT].tolist() == [0.5] * 4  # two pairs, half the loss each
    assert sequence_fields(4, dpo, critic=True) == {}
    assert sequence_fields(4, LossConfig(preset="grpo")) == {}
    batch = _plain_batch([3, 5, 2, 4], paired=True)
    weights = batch_loss_weights(batch, dpo)  # token-mean whatever loss_agg says
    assert torch.cat(weights).tolist() == pytest.approx([0.0, 1 / 10, 1 / 10, 0.0, *[1 / 10] * 4,
                                                        0.0, 1 / 10, 0.0, *[1 / 10] * 3])
    seq_sum = batch_loss_weights(batch, LossConfig(preset="grpo").model_copy(
        update={"loss_agg": "seq-mean-token-sum"}))
    assert float(seq_sum[0].sum()) == pytest.approx(2 / 4)  # 2 loss tokens over 4 sequences

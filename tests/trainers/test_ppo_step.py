"""`ppo_step` with real torch backends (micro model): the values GAE uses are the critic's, the
critic-only warm-up leaves the actor alone, and every epoch visits every mini-batch."""

from __future__ import annotations

import pytest
import torch

from palaestra.config import load_config
from palaestra.trainers.algorithms.advantages import gae_advantages, turn_token_rewards
from palaestra.trainers.batching import TrainBatch, pad_ragged
from palaestra.run.config import TrainConfig

QUICKSTART_PPO = "configs/quickstart_ppo.toml"


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    from palaestra.tiny_model import build_model

    torch.set_num_threads(1)
    return build_model(tmp_path_factory.mktemp("ppo_step") / "model", "micro")


def _cfg(model, **over: str) -> TrainConfig:
    args = ["--model.path", str(model), "--model.init_size", "micro", "--trainer.torch.lr", "0.01",
            "--critic.lr", "0.01", "--trainer.loss.use_turn_rewards", "true",
            "--trainer.mini_batch_size", "3", "--trainer.loss.gae_lambda", "0.9"]
    for k, v in over.items():
        args += [f"--{k}", v]
    return load_config(TrainConfig, QUICKSTART_PPO, args)


def _batch() -> TrainBatch:
    gen = torch.Generator().manual_seed(0)
    tokens, masks, rewards, ends = [], [], [], []
    for i in range(6):  # [prompt x3, turn 1 x4, tool x3, turn 2 x(3+i)]
        n = 13 + i
        tokens.append(torch.randint(5, 200, (n,), generator=gen))
        masks.append(torch.tensor([0.0] * 3 + [1.0] * 4 + [0.0] * 3 + [1.0] * (3 + i)))
        rewards.append((0.1 * i, float(i % 2)))
        ends.append((10, n))
    return TrainBatch(token_ids=tokens, loss_mask=masks, rewards=torch.tensor([1.0] * 6),
                      turn_rewards=tuple(rewards), turn_ends=tuple(ends))


def _actor(cfg: TrainConfig, model):
    from palaestra.run.builders import build_backend

    return build_backend(cfg.trainer, model, temperature=cfg.rollout.temperature, seed=cfg.seed)


def _weights(backend) -> list[torch.Tensor]:
    return [p.detach().clone() for p in backend.model.parameters()]


def test_values_gae_warmup_and_mini_batches(micro):
    from palaestra.run.phases.critic import build_critic
    from palaestra.trainers.ppo.step import ppo_step

    cfg = _cfg(micro, **{"critic.warmup_steps": "1", "trainer.updates_per_batch": "2"})
    actor, critic = _actor(cfg, micro), build_critic(cfg, micro)
    assert critic.config.critic and not actor.config.critic and critic.config.lr == 0.01
    batch = _batch()
    values = critic.forward_values(batch)
    actor_before, critic_before = _weights(actor), _weights(critic)

    out = ppo_step(cfg, actor, critic, batch, step=0)  # the critic's warm-up step
    for v, w in zip(out.batch.old_values, values):
        assert torch.equal(v, w)  # GAE ran on the critic's values before its update
    rewards = pad_ragged([turn_token_rewards(r, e, m) for r, e, m in
                          zip(batch.turn_rewards, batch.turn_ends, batch.loss_mask)])
    _, returns = gae_advantages(rewards, pad_ragged(values), pad_ragged(batch.loss_mask),
                                gamma=1.0, lam=0.9)
    torch.testing.assert_close(pad_ragged(out.batch.returns), returns)
    assert out.metrics["ppo/critic_updates"] == 4 and out.metrics["ppo/actor_updates"] == 0
    assert all(torch.equal(a, b) for a, b in zip(actor_before, _weights(actor)))
    assert not all(torch.equal(a, b) for a, b in zip(critic_before, _weights(critic)))
    assert out.batch.old_logprobs is None  # no actor update, no pi_old needed

    out = ppo_step(cfg, actor, critic, batch, step=1)
    assert out.metrics["ppo/actor_updates"] == 4  # 2 epochs x mini-batches of 3 of 6
    assert out.batch.old_logprobs is not None
    assert not all(torch.equal(a, b) for a, b in zip(actor_before, _weights(actor)))
    assert out.metrics["actor/clip_frac"] >= 0 and "critic/value_clip_frac" in out.metrics
    assert set(out.times) >= {"time/values_s", "time/critic_s", "time/actor_s"}
    # the critic learns the returns of this fixed batch: its loss falls over the steps
    first = out.metrics["critic/value_loss"]
    for step in range(2, 6):
        out = ppo_step(cfg, actor, critic, batch, step=step)
    assert out.metrics["critic/value_loss"] < first


def test_reward_kl_uses_the_reference_before_the_advantages(micro):
    from palaestra.run.phases.critic import build_critic
    from palaestra.trainers.ppo.step import ppo_step

    cfg = _cfg(micro, **{"trainer.loss.kl_coef": "0.5", "trainer.loss.kl_mode": "reward",
                         "trainer.torch.ref_model": "true", "trainer.updates_per_batch": "1",
                         "trainer.mini_batch_size": "6"})
    actor, critic = _actor(cfg, micro), build_critic(cfg, micro)
    batch = _batch()
    with torch.no_grad():  # move the policy off the reference, so the KL is not 0
        for p in actor.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    values = critic.forward_values(batch)
    out = ppo_step(cfg, actor, critic, batch, step=0)
    assert out.batch.ref_logprobs is not None and out.batch.old_logprobs is not None
    no_kl = _cfg(micro, **{"trainer.updates_per_batch": "1", "trainer.mini_batch_size": "6"})
    from palaestra.trainers.algorithms.estimators import compute_advantages

    plain = compute_advantages(batch, no_kl.trainer.loss, values=values)
    # with KL in the reward the returns are lower by the (positive) k3 penalties
    diff = pad_ragged(plain.returns) - pad_ragged(out.batch.returns)
    assert (diff.sum() > 0) and torch.isfinite(diff).all()

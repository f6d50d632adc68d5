"""A decaying RL learning rate spans the policy's optimizer steps, not its rollout batches: PPO's
epochs x mini-batches (and GRPO's ``updates_per_batch``) take several steps per batch, and a
schedule over ``trainer.steps`` alone would sit at its floor for most of the run."""

from __future__ import annotations

import pytest

from palaestra.config import load_config
from palaestra.run.config import TrainConfig


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    from palaestra.tiny_model import build_model

    return build_model(tmp_path_factory.mktemp("schedule") / "model", "micro")


def _cfg(config: str, model, *over: str) -> TrainConfig:
    return load_config(TrainConfig, config, [
        "--model.path", str(model), "--model.init_size", "micro",
        "--trainer.torch.lr_schedule", "cosine", *over])


def test_ppo_actor_decays_over_epochs_times_mini_batches(micro):
    from palaestra.run.builders import build_backend
    from palaestra.run.phases.critic import optimizer_steps
    from palaestra.trainers.torch_backend.optim import lr_multiplier

    # 40 batches of 16 x 8 episodes, 2 epochs of 2 mini-batches of 64: 160 actor steps
    cfg = _cfg("configs/quickstart_ppo.toml", micro)
    assert optimizer_steps(cfg) == 160
    actor = build_backend(cfg.trainer, micro, temperature=1.0, seed=0,
                          optimizer_steps=optimizer_steps(cfg))
    assert actor.config.total_steps == 160
    # halfway through the run the rate is half the peak (over 40 steps it would be 0 already)
    assert lr_multiplier(80, actor.config) == pytest.approx(0.5)


def test_grpo_counts_its_updates_per_batch(micro):
    from palaestra.run.phases.critic import optimizer_steps

    cfg = _cfg("configs/quickstart.toml", micro, "--trainer.steps", "30",
               "--trainer.updates_per_batch", "3")
    assert optimizer_steps(cfg) == 90  # GRPO updates on the whole batch (no mini-batches)

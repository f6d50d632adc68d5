"""PPO with a critic on one GPU: 3 steps of `palaestra train` on the Qwen3-0.6B
layer shapes (random init, the quickstart's tokenizer), actor and critic on the same backend:
torch + torch, then Megatron + Megatron. Skipped without CUDA (and Megatron without
megatron-core). ``PALAESTRA_GPU_REPORT=DIR`` writes each run's per-step breakdown there."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from palaestra.config import load_config
from palaestra.run.config import TrainConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["--model.init_size", "qwen3-0.6b", "--warmup.steps", "0", "--trainer.steps", "3",
         "--rollout.batch_size", "16", "--rollout.group_size", "4",
         "--rollout.max_new_tokens", "128", "--trainer.mini_batch_size", "32",
         "--critic.warmup_steps", "0", "--critic.lr", "1e-5", "--eval.num_tasks", "16",
         "--checkpoint.interval", "3", "--logging.tensorboard", "false",
         "--logging.progress", "false", "--engine.device", "cuda"]
BACKENDS = {
    "torch": ["--trainer.torch.device", "cuda", "--trainer.torch.lr", "1e-5",
              "--trainer.torch.max_tokens_per_micro_batch", "16384"],
    "megatron": ["--trainer.backend", "megatron", "--trainer.megatron.lr", "1e-5",
                 "--trainer.megatron.dtype", "bfloat16"],
}
BREAKDOWN = ("time/step_s", "time/rollout_s", "time/train_s", "time/logprobs_s",
             "time/values_s", "time/critic_update_s", "time/actor_update_s", "time/critic_s",
             "time/actor_s", "time/weight_sync_s")


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_three_ppo_steps_with_a_critic_on_the_same_backend(tmp_path, backend):
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    from palaestra.run.train import train

    run = tmp_path / "run"
    cfg = load_config(TrainConfig, ROOT / "configs" / "quickstart_ppo.toml",
                      ["--out", str(run), *SHORT, *BACKENDS[backend]])
    assert cfg.trainer.loss.needs_values and (cfg.critic.backend or cfg.trainer.backend) == backend
    train(cfg)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    rl = [r for r in map(json.loads, filter(None, lines)) if r["phase"] == "rl"]
    out = os.environ.get("PALAESTRA_GPU_REPORT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"ppo_{backend}.json").write_text(json.dumps(
            [{k: r.get(k) for k in (*BREAKDOWN, "reward_mean", "train/ppo/explained_variance",
                                    "train/critic/value_loss")} for r in rl], indent=1))
    assert [r["version"] for r in rl] == [0, 1, 2]
    for r in rl:  # 64 episodes in mini-batches of 32, 2 epochs (the quickstart's)
        assert r["train/ppo/critic_updates"] == 4 and r["train/ppo/actor_updates"] == 4, r
        assert math.isfinite(r["train/critic/value_loss"]) and r["train/critic/grad_norm"] > 0
        # a random-init policy scores 0 everywhere: returns without variance leave the
        # explained variance undefined (nan), which is what it should say then
        if r["reward/std"] > 0:
            assert math.isfinite(r["train/ppo/explained_variance"])
    assert (run / "final-critic" / "config.json").exists()
    assert (run / "checkpoints" / "rl-000003" / "critic").is_dir()

"""Bitwise on-policy mode end to end on CUDA: a short quickstart run (``configs/quickstart.toml``,
the embedded engine and the torch backend on one GPU, bfloat16, the Triton kernels) in which
every RL step's sampled-token logprob gap and full-vocabulary parity numbers are exactly 0.0,
with full fine-tuning and with a LoRA adapter. Skipped without CUDA; written for one H200.
"""

from __future__ import annotations

import json
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
STEPS = 4
SHORT = ["--warmup.steps", "0", "--trainer.steps", str(STEPS), "--rollout.batch_size", "8",
         "--rollout.group_size", "4", "--eval.num_tasks", "0", "--checkpoint.interval",
         str(STEPS), "--logging.tensorboard", "false", "--logging.progress", "false",
         "--engine.device", "cuda", "--trainer.torch.device", "cuda",
         "--trainer.on_policy", "bitwise", "--trainer.parity_positions", "16",
         # without a warm start the tiny policy earns no reward, so every advantage is 0: the
         # entropy bonus keeps every update non-trivial (each step checks new weights)
         "--trainer.loss.entropy_coef", "0.01"]
#: every one exactly 0.0 on every step
ZERO = ("rollout/logprob_max_abs_diff", "rollout/ratio_max_abs_dev",
        "rollout/full_vocab_logprob_max_abs_diff", "rollout/full_vocab_tv",
        "rollout/full_vocab_replay_max_abs_diff")


def _rl_records(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if r["phase"] == "rl"]


def _check(run: Path) -> None:
    rl = _rl_records(run)
    keys = (*ZERO, "rollout/full_vocab_positions", "time/parity_s", "train/grad_norm")
    table = {k: [r.get(k) for r in rl] for k in keys}
    print(json.dumps(table, indent=1))
    assert [r["step"] for r in rl] == list(range(STEPS)), table
    for key in ZERO:
        assert table[key] == [0.0] * STEPS, (key, table[key])
    assert table["rollout/full_vocab_positions"] == [16.0] * STEPS, table
    assert all(g > 0 for g in table["train/grad_norm"]), table  # the weights changed


def test_bitwise_quickstart_on_cuda_has_zero_gaps_every_step(tmp_path):
    from palaestra.run.train import train

    run = tmp_path / "run"
    train(load_config(TrainConfig, ROOT / "configs" / "quickstart.toml",
                      ["--out", str(run), *SHORT]))
    _check(run)


def test_bitwise_lora_quickstart_on_cuda_has_zero_gaps_every_step(tmp_path):
    pytest.importorskip("peft")
    from palaestra.run.train import train

    run = tmp_path / "run"
    train(load_config(TrainConfig, ROOT / "configs" / "quickstart.toml",
                      ["--out", str(run), *SHORT, "--trainer.torch.lora",
                       "{rank = 8, alpha = 16.0}", "--trainer.torch.lr", "1e-3"]))
    _check(run)

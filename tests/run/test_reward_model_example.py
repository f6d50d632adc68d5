"""The reward-model example, shortened: a reward model trained by ``palaestra train`` on
preference pairs of ``palaestra/HiddenRule-v0`` (the number must also be even, which no prompt
says) learns the rule, and RL against that reward model alone (the env's reward weight 0, only
measured) raises the task's true held-out success above the SFT warm start's."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from palaestra.config import validate
from palaestra.run.config import TrainConfig

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("OMP_NUM_THREADS", "1")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
# configs/rm_train.toml and configs/rl_with_rm.toml, shortened: fewer pairs and RM steps (so a
# stronger KL to the SFT policy than the example's 0.1), the example's SFT, 15 of its 20 RL steps
RM_STEPS, SFT_STEPS, RL_STEPS = 100, 150, 15
NUM_PAIRS = 1600
KL = 0.3


def _make_pairs():
    spec = importlib.util.spec_from_file_location(
        "make_rm_example_data", REPO / "scripts" / "make_rm_example_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.make_pairs


def _evals(run: Path) -> dict[str, dict]:
    return {e["stage"]: e for e in map(json.loads, (run / "eval.jsonl").read_text().splitlines())}


def test_rl_against_a_trained_rm_raises_true_success(tmp_path):
    import torch

    from palaestra.run.train import train

    torch.set_num_threads(1)
    logging = {"progress": False, "tensorboard": False}
    dataset = tmp_path / "pairs.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in _make_pairs()(NUM_PAIRS, seed=1)))
    rm = validate(TrainConfig, {
        "algorithm": "rm", "out": str(tmp_path / "rm"), "seed": 0,
        "model": {"init_size": "tiny"},
        "offline": {"dataset": str(dataset), "batch_size": 32},
        "trainer": {"steps": RM_STEPS, "torch": {"device": "cpu", "lr": 2e-3}},
        "eval": {"num_tasks": 100, "interval": RM_STEPS},
        "checkpoint": {"interval": RM_STEPS},
        "logging": logging,
    })
    train(rm)
    rm_evals = _evals(tmp_path / "rm")
    assert rm_evals["rm"]["accuracy"] >= 0.8 > rm_evals["init"]["accuracy"] + 0.15, rm_evals

    rl = validate(TrainConfig, {
        "out": str(tmp_path / "rl"), "seed": 0,
        "model": {"init_size": "tiny"},
        "env": {"id": "palaestra/HiddenRule-v0"},
        "data": {"num_tasks": 512},
        "agent": {"max_context": 128, "tools_in_prompt": False},
        "warmup": {"steps": SFT_STEPS, "batch_size": 32, "lr": 3e-3, "num_demonstrations": 4096,
                   "demonstrations": "palaestra.envs.hidden_rule:demonstrations"},
        "rollout": {"cluster": "local", "num_workers": 1, "batch_size": 16, "group_size": 8,
                    "max_new_tokens": 12, "temperature": 1.0},
        "engine": {"device": "cpu", "max_running": 64},
        "trainer": {"steps": RL_STEPS, "loss": {"preset": "grpo", "kl_coef": KL},
                    "torch": {"device": "cpu", "lr": 5e-4, "pack_sequences": False,
                              "ref_model": True}},
        "eval": {"num_tasks": 200, "temperature": 1.0},
        "rewards": [{"kind": "classifier", "name": "rm", "path": str(tmp_path / "rm" / "final-model")},
                    {"kind": "env", "weight": 0.0}],
        "logging": logging,
    })
    train(rl)
    evals = _evals(tmp_path / "rl")
    assert list(evals) == ["init", "sft", "rl"], evals
    init, sft, final = (evals[s]["success_rate"] for s in ("init", "sft", "rl"))
    # SFT knows the range but not the rule (about half of its picks are right); the reward model
    # is the only thing that knows it
    assert init <= 0.1 and 0.25 <= sft <= 0.75, evals
    assert final >= sft + 0.2 and final >= 0.7, evals
    metrics = [json.loads(x) for x in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    rl_rows = [m for m in metrics if m["phase"] == "rl"]
    assert all(m["reward_mean"] == pytest.approx(m["reward/rm"]) for m in rl_rows)  # RM alone
    env = [m["reward/env"] for m in rl_rows]  # the true success of the training episodes
    assert sum(env[-5:]) / 5 >= env[0] + 0.15, env


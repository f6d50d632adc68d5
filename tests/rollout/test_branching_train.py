"""`palaestra train` with ``--rollout.branching``: a multi-turn env whose episodes fork before
turns 1 and 2, trained with tree advantages, end to end through the real CLI (slow: ~60 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PALAESTRA = Path(sys.executable).with_name("palaestra")

PICK_ENV = '"""Pick a or b three times: reward = the share of turns that said "a" (a multi-turn RL target)."""\nimport random\n\nimport palaestra.envs as envs\nfrom palaestra.envs import StepResult\nfrom palaestra.envs.base import MultiTurnEnv\nfrom palaestra.types import Message\n\n\nclass PickEnv(MultiTurnEnv):\n    step_in_thread = False\n\n    def __init__(self, **kwargs):\n        super().__init__(max_turns=3, **kwargs)\n        self.picks = 0\n\n    def sample_task(self, rng):\n        return {"id": int(rng.integers(1_000_000))}\n\n    def on_reset(self, task):\n        self.picks = 0\n\n    def initial_messages(self, task):\n        return [Message("user", "Say a or b.")]\n\n    def respond(self, action):\n        self.picks += "a" in action.content\n        return StepResult([Message("user", "Again: a or b.")], 0.0)\n\n    def final_reward(self):\n        return self.picks / self.max_turns\n\n\ndef demonstrations(n, *, seed=0, env_kwargs=None):\n    rng = random.Random(seed)\n    out = []\n    for _ in range(n):\n        msgs = [{"role": "user", "content": "Say a or b."}]\n        for t in range(3):\n            msgs.append({"role": "assistant", "content": rng.choice("ab")})\n            if t < 2:\n                msgs.append({"role": "user", "content": "Again: a or b."})\n        out.append(msgs)\n    return out\n\n\nenvs.register("tests/Pick-v0", entry_point=PickEnv)\n'

CONFIG = 'out = "{out}"\nseed = 0\n[model]\npath = "{model}"\n[env]\nid = "branch_env:tests/Pick-v0"\n[data]\nnum_tasks = 64\n[agent]\nmax_context = 256\ntools_in_prompt = false\n[warmup]\nsteps = 120\nbatch_size = 16\nlr = 3e-3\ndemonstrations = "branch_env:demonstrations"\nnum_demonstrations = 256\n[rollout]\ncluster = "local"\nnum_workers = 1\nbatch_size = 4\ngroup_size = 4\nmax_new_tokens = 8\ntemperature = 1.0\n[engine]\ndevice = "cpu"\nmax_running = 64\n[trainer]\nsteps = 3\n[trainer.torch]\ndevice = "cpu"\npack_sequences = false\n[trainer.loss]\npreset = "grpo"\nadvantage_estimator = "tree"\n[eval]\nnum_tasks = 0\n[checkpoint]\ninterval = 10\nkeep_last = 1\n[logging]\nprogress = false\ntensorboard = false\n'


@pytest.mark.slow
def test_train_with_branching_groups_and_tree_advantages(tmp_path: Path) -> None:
    from palaestra.tiny_model import build_model

    model = build_model(tmp_path / "model", "micro")
    (tmp_path / "branch_env.py").write_text(PICK_ENV)
    config = tmp_path / "run.toml"
    out = tmp_path / "run"
    config.write_text(CONFIG.format(out=out, model=model))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [str(PALAESTRA), "train", str(config), "--rollout.branching",
         "{turns = [1, 2], width = 2}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    resolved = json.loads((out / "config.json").read_text())
    assert resolved["rollout"]["branching"] == {"turns": [1, 2], "width": 2}
    assert resolved["trainer"]["loss"]["advantage_estimator"] == "tree"
    rl = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
          if line.strip() and '"rl"' in line]
    rl = [m for m in rl if "train/actor/pg_loss" in m]
    assert [m["step"] for m in rl] == [0, 1, 2]
    # after the SFT warm start most episodes play all three turns (so the trees fork)
    assert sum(m["turns/mean"] for m in rl) / len(rl) > 2.0
    assert any(m["train/num_loss_tokens"] > 0 and m["train/actor/pg_loss"] != 0 for m in rl)


def test_branching_the_group_cannot_hold_is_refused(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [str(PALAESTRA), "train", str(root / "configs" / "quickstart.toml"), "--out",
         str(tmp_path / "run"), "--rollout.branching", "{turns = [1], width = 3}", "--dry-run"],
        cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=120, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "rollout.group_size = 8 leaves cannot be split into trees of 3" in proc.stderr
    assert not (tmp_path / "run").exists()

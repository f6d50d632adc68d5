"""In-flight episodes survive ``kill -9`` of ``palaestra train`` (async mode, CPU, real CLI).

Three runs of the same seeded config: A uninterrupted; B killed with SIGKILL as soon as its
step-1 checkpoint is complete, with the episodes of batch 1 in flight (the test env holds them
after their first turn until step 0's metrics are written, so they are deterministically past
turn 0 and before their last turn when the checkpoint pauses them); B' resumes B. The resumed
run plays those episodes on from their last completed turn (no reset, only the remaining env
steps) and their turns, and step 1's training metrics, equal A's (slow: three CLI runs).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

PALAESTRA = Path(sys.executable).with_name("palaestra")

HOLD_ENV = '''"""Pick a or b three times; logs every reset and step; holds batch 1 after its first turn."""
import asyncio
import json
import os
import random

import palaestra.envs as envs
from palaestra.envs import StepResult
from palaestra.envs.base import MultiTurnEnv
from palaestra.types import Message

_RESETS = [0]  # episodes reset in this process (the envs of a local worker share it)


class HoldEnv(MultiTurnEnv):
    step_in_thread = False

    def __init__(self, log="", metrics="", group=2, **kwargs):
        super().__init__(max_turns=3, **kwargs)
        self.picks, self.log, self.metrics, self.group = 0, log, metrics, group
        self.episode_seed, self.hold_until = None, 0

    def reset(self, *, seed=None, options=None):
        _RESETS[0] += 1
        self.episode_seed = seed
        self.hold_until = (_RESETS[0] - 1) // self.group  # group n waits for step n-1's metrics
        self._write({"event": "reset"})
        return super().reset(seed=seed, options=options)

    def sample_task(self, rng):
        return {"id": int(rng.integers(1_000_000))}

    def on_reset(self, task):
        self.picks = 0

    def initial_messages(self, task):
        return [Message("user", "Say a or b.")]

    async def aon_action(self, action):
        while self.turn == 1 and self._rl_records() < self.hold_until:
            await asyncio.sleep(0.01)
        self._write({"event": "step", "turn": self.turn, "text": action.content})
        return self.on_action(action)

    def respond(self, action):
        self.picks += "a" in action.content
        return StepResult([Message("user", "Again: a or b.")], 0.0)

    def final_reward(self):
        return self.picks / self.max_turns

    def _rl_records(self):
        try:
            with open(self.metrics) as f:
                return sum(json.loads(line).get("phase") == "rl" for line in f if line.strip())
        except (OSError, ValueError):
            return 0

    def _write(self, record):
        with open(self.log, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "seed": self.episode_seed, **record}) + "\\n")


def demonstrations(n, *, seed=0, env_kwargs=None):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs = [{"role": "user", "content": "Say a or b."}]
        for t in range(3):
            msgs.append({"role": "assistant", "content": rng.choice("ab")})
            if t < 2:
                msgs.append({"role": "user", "content": "Again: a or b."})
        out.append(msgs)
    return out


envs.register("tests/Hold-v0", entry_point=HoldEnv)
'''

CONFIG = '''out = "{out}"
seed = 0
[model]
path = "{model}"
[env]
id = "inflight_env:tests/Hold-v0"
kwargs = {{log = "{out}.events.jsonl", metrics = "{out}/metrics.jsonl", group = 2}}
[data]
num_tasks = 32
[agent]
max_context = 256
tools_in_prompt = false
[warmup]
steps = {warmup}
batch_size = 16
lr = 5e-3
demonstrations = "inflight_env:demonstrations"
num_demonstrations = 256
[rollout]
cluster = "local"
num_workers = 1
mode = "async"
batch_size = 1
group_size = 2
max_new_tokens = 8
temperature = 1.0
[engine]
device = "cpu"
[trainer]
steps = 2
[trainer.torch]
device = "cpu"
pack_sequences = false
[trainer.loss]
preset = "grpo"
[eval]
num_tasks = 0
[checkpoint]
interval = 1
keep_last = 3
[logging]
progress = false
tensorboard = false
'''


def _events(out: Path) -> list[dict[str, Any]]:
    path = Path(f"{out}.events.jsonl")
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _rl_metrics(out: Path) -> dict[int, dict[str, Any]]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r for r in rows if r.get("phase") == "rl"}


def _config(tmp: Path, name: str, model: Path, warmup: int) -> tuple[Path, Path]:
    out = tmp / name
    config = tmp / f"{name}.toml"
    config.write_text(CONFIG.format(out=out, model=model, warmup=warmup))
    return config, out


@pytest.mark.slow
def test_train_killed_after_a_checkpoint_resumes_its_inflight_episodes(tmp_path: Path) -> None:
    from palaestra.rollout.inflight import decode_inflight
    from palaestra.tiny_model import build_model

    (tmp_path / "inflight_env.py").write_text(HOLD_ENV)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    def train(config: Path, **kw: Any) -> Any:
        return subprocess.Popen([str(PALAESTRA), "train", str(config)], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)

    # A: the SFT warm start (episodes that stop after a letter), then two async RL steps
    config_a, out_a = _config(tmp_path, "a", build_model(tmp_path / "model", "micro"), 50)
    proc = train(config_a)
    log_a = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, log_a[-4000:]
    warm = out_a / "sft-model"
    print("run A phases:", (out_a / "timing.json").read_text().replace("\n", " "))

    # B: the same RL from the warm model, killed as soon as checkpoint rl-1 is complete
    config_b, out_b = _config(tmp_path, "b", warm, 0)
    proc = train(config_b)
    marker = out_b / "checkpoints" / "rl-000001" / "COMPLETE"
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert marker.exists(), proc.communicate(timeout=10)[0][-4000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not (out_b / "checkpoints" / "rl-000002" / "COMPLETE").exists()
    state = json.loads((marker.parent / "backend_state.json").read_text())["rollout"]
    entry = state["inflight"]
    groups, ready, _ = decode_inflight(entry)
    live = {e.state.seed: e for g in groups for e in g.live if e is not None}
    assert len(live) == 2 and not ready, entry | {"data": "..."}
    done = {seed: len(e.state.turns) for seed, e in live.items()}
    assert all(1 <= n < 3 for n in done.values()), done  # past turn 0, not finished
    print(f"in-flight state: {entry['bytes']} bytes for {entry['episodes']} episodes "
          f"({entry['bytes'] / entry['episodes']:.0f} bytes/episode)")
    killed_pid = {e["pid"] for e in _events(out_b)}

    # B': resume B
    proc = train(config_b)
    log_b = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, log_b[-4000:]
    assert "resumed RL from rl-000001" in log_b, log_b[-3000:]
    resumed = [e for e in _events(out_b) if e["pid"] not in killed_pid]
    mine = [e for e in resumed if e["seed"] in live]
    # no episode of the checkpoint restarted; only the turns left after its last completed one
    assert not [e for e in mine if e["event"] == "reset"]
    for seed, n in done.items():
        assert [e["turn"] for e in mine if e["seed"] == seed] == list(range(n + 1, 4))

    # the same turns as the uninterrupted run: before the kill from B, after it from B'
    def turns(events: list[dict[str, Any]], seed: int) -> list[tuple[int, str]]:
        return [(e["turn"], e["text"]) for e in events if e["seed"] == seed
                and e["event"] == "step"]

    before = [e for e in _events(out_b) if e["pid"] in killed_pid]
    for seed, n in done.items():
        assert turns(_events(out_a), seed) == turns(before, seed)[:n] + turns(mine, seed)
    # and step 1 trained on the same samples (tokens, logprobs, versions, rewards)
    a, b = _rl_metrics(out_a)[1], _rl_metrics(out_b)[1]
    for key in ("reward_mean", "train/loss", "train/grad_norm", "response_length_mean",
                "staleness/max", "train/num_loss_tokens"):
        assert a.get(key) == b.get(key), (key, a.get(key), b.get(key))
    assert b["episodes/restored"] == 2

"""PPO with a learned critic in `palaestra train`, end to end on CPU (micro model, real engine).

A short SFT warm start on 30% "yes" demonstrations, then PPO on tests/Yes-v0 (reward 1 when the
reply says "yes"): the critic (the SFT model with a fresh value head) must come to explain the
returns (explained variance > 0) and the policy's reward must go up. A run killed with SIGKILL
after a mid-PPO checkpoint and started again trains exactly as an uninterrupted one: the same
metrics of both models at every step and the same final weights of the actor and the critic.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

YES_ENV = '''
"""Say yes: reward 1 when the reply contains "yes"."""
import palaestra.envs as envs
from palaestra.envs import Env, StepResult
from palaestra.types import Message


class YesEnv(Env):
    step_in_thread = False

    def sample_task(self, rng):
        return {"id": int(rng.integers(1_000_000)), "question": "Say yes or no."}

    def initial_messages(self, task):
        return [Message("user", task["question"])]

    def on_action(self, action):
        return StepResult(reward=float("yes" in action.content), terminated=True)


envs.register("tests/PPOYes-v0", entry_point=YesEnv)
'''


def _config(tmp: Path, out: Path, model: Path, *, steps: int, extra: str = "") -> Path:
    path = tmp / f"{out.name}.toml"
    path.write_text(f'''
out = "{out}"
seed = 1
[model]
path = "{model}"
[env]
id = "ppo_yes_env:tests/PPOYes-v0"
[data]
num_tasks = 256
[agent]
max_context = 256
tools_in_prompt = false
[warmup]
steps = 40
batch_size = 32
lr = 0.01
demonstrations = "{tmp / 'demos.jsonl'}"
[rollout]
cluster = "local"
num_workers = 1
max_new_tokens = 8
batch_size = 8
group_size = 8
[engine]
device = "cpu"
[trainer]
steps = {steps}
updates_per_batch = 2
mini_batch_size = 32
[trainer.torch]
device = "cpu"
lr = 0.002
pack_sequences = false
[trainer.loss]
preset = "ppo"
gae_lambda = 1.0
[critic]
lr = 0.003
warmup_steps = 1
[eval]
num_tasks = 32
[checkpoint]
interval = 1
keep_last = 2
[logging]
progress = false
tensorboard = false
{extra}''')
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from palaestra.tiny_model import build_model

    tmp = tmp_path_factory.mktemp("ppo")
    (tmp / "ppo_yes_env.py").write_text(YES_ENV)
    with (tmp / "demos.jsonl").open("w") as f:
        for i in range(100):
            reply = "yes" if i % 10 < 3 else "no"
            f.write(json.dumps({"messages": [{"role": "user", "content": "Say yes or no."},
                                             {"role": "assistant", "content": reply}]}) + "\n")
    model = build_model(tmp / "model", "micro")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": f"{tmp}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return tmp, model, env


def _rl(out: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r for r in rows if r["phase"] == "rl"}


def _train(config: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "palaestra", "train", str(config)], check=False,
                          env=env, capture_output=True, text=True, timeout=400)


@pytest.mark.slow
def test_ppo_with_a_critic_learns_and_the_critic_explains_the_returns(setup):
    tmp, model, env = setup
    out = tmp / "learn"
    proc = _train(_config(tmp, out, model, steps=8), env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rl = _rl(out)
    steps = [rl[s] for s in sorted(rl)]
    ev = [r["train/ppo/explained_variance"] for r in steps]
    reward = [r["reward_mean"] for r in steps]
    assert steps[0]["train/ppo/actor_updates"] == 0  # critic warm-up: the actor waits
    assert all(r["train/ppo/actor_updates"] == 4 and r["train/ppo/critic_updates"] == 4
               for r in steps[1:])  # 2 epochs x 2 mini-batches of 32 of the 64 episodes
    assert max(ev[-3:]) > 0.0, f"the critic never explained the returns: {ev}"
    assert ev[-1] > ev[0], ev
    assert reward[0] < 0.6 and sum(reward[-2:]) / 2 > reward[0] + 0.2, reward
    for key in ("train/critic/value_loss", "train/critic/value_clip_frac", "train/ppo/value_mean",
                "train/ppo/return_mean", "train/ppo/advantage_std", "time/critic_s",
                "time/actor_s", "train/actor/clip_frac"):
        assert all(key in r for r in steps[1:]), key
    # the engine-vs-trainer logprob mismatch, from PPO's pi_old forward (before the updates)
    diffs = [(r["rollout/logprob_mean_abs_diff"], r["rollout/logprob_max_abs_diff"])
             for r in steps[1:]]
    assert all(0.0 <= mean <= top < 1e-3 for mean, top in diffs), diffs  # fp32: ~1e-6
    assert not any(k.startswith("train/rollout/") for r in steps for k in r)
    evals = {json.loads(x)["stage"]: json.loads(x)["success_rate"]
             for x in (out / "eval.jsonl").read_text().splitlines()}
    assert evals["rl"] > evals["sft"], evals
    assert (out / "final-critic" / "config.json").exists()
    assert (out / "curves.png").stat().st_size > 0


_TIMING = ("time/", "perf/", "drift/", "sync/", "time_s",
           "engine/")  # engine/: the scheduler's seconds, which follow the clock


def _exact(record: dict) -> dict:
    return {k: v for k, v in record.items()
            if not any(k.startswith(p) for p in _TIMING) and not k.endswith("time_s")
            and not k.endswith("logprobs_s")}


@pytest.mark.slow
def test_a_ppo_run_killed_mid_way_resumes_exactly_with_both_models(setup):
    from safetensors.torch import load_file

    tmp, model, env = setup
    steps = 5
    full, killed = tmp / "full", tmp / "killed"
    cmd = [sys.executable, "-m", "palaestra", "train"]
    first = subprocess.Popen([*cmd, str(_config(tmp, full, model, steps=steps))], env=env,
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    config = _config(tmp, killed, model, steps=steps)
    proc = subprocess.Popen([*cmd, str(config)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    mark = killed / "checkpoints" / "rl-000002" / "COMPLETE"  # after the critic-only step
    deadline = time.time() + 300
    while time.time() < deadline and not mark.exists() and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _, err = first.communicate(timeout=400)
    assert first.returncode == 0, err[-3000:]
    assert mark.exists(), "no checkpoint before the kill"
    assert not (killed / "final-model").exists(), "the run finished before it was killed"
    again = _train(config, env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed RL from rl-00000" in again.stdout
    a, b = _rl(full), _rl(killed)
    assert sorted(b) == list(range(steps)), "steps are missing or repeated after the resume"
    for step in range(steps):
        x, y = _exact(a[step]), _exact(b[step])
        # engine logprobs: float rounding of its batch (~1e-6), in these diagnostics
        for kl in ("train/actor/rollout_kl", "rollout/logprob_max_abs_diff",
                   "rollout/logprob_mean_abs_diff"):
            assert x.pop(kl, 0.0) == pytest.approx(y.pop(kl, 0.0), abs=1e-5)
        assert x == y, (step, {k: (x.get(k), y.get(k)) for k in x if x.get(k) != y.get(k)})
    assert all(a[s]["train/critic/grad_norm"] > 0 for s in a)
    last = f"rl-{steps:06d}"
    for part in ("model.safetensors", "critic/model.safetensors"):
        wa = load_file(str(full / "checkpoints" / last / part))
        wb = load_file(str(killed / "checkpoints" / last / part))
        assert wa.keys() == wb.keys()
        assert all((wa[k] == wb[k]).all() for k in wa), part
    wa = load_file(str(full / "checkpoints" / last / "critic/model.safetensors"))
    assert any("score" in k for k in wa), "the critic checkpoint has no value head"

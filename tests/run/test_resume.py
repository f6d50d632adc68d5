"""Runs that resume exactly, and run directories that refuse other settings.

A real GRPO run (micro model built here, in-process engine, `palaestra train` in a subprocess) is
killed with SIGKILL after a checkpoint and started again; every step's rewards, losses and
gradient norms equal those of an uninterrupted run. The env sleeps a random time on each step, so
the two runs finish their episodes in different orders, and gives a NaN reward on some replies
(those episodes fail, are logged to failures.jsonl and never reach a batch).
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

SLEEPY_ENV = '''
"""Reward by reply length, a random sleep per step (completion order varies), NaN sometimes."""
import asyncio
import random

import palaestra.envs as envs
from palaestra.envs import Env, StepResult
from palaestra.types import Message

_jitter = random.Random()  # unseeded on purpose: timing differs from run to run


class SleepyEnv(Env):
    def sample_task(self, rng):
        return {"id": int(rng.integers(1_000_000)), "question": "Say something long."}

    def initial_messages(self, task):
        return [Message("user", task["question"])]

    async def aon_action(self, action):
        await asyncio.sleep(_jitter.random() * 0.02)
        n = len(action.content)
        reward = float("nan") if n % 7 == 3 else min(n, 40) / 40
        return StepResult(reward=reward, terminated=True)


envs.register("tests/Sleepy-v0", entry_point=SleepyEnv)
'''

STEPS = 6


def _config(tmp: Path, out: Path, model: Path, steps: int = STEPS, extra: str = "") -> Path:
    path = tmp / f"{out.name}-{steps}.toml"
    path.write_text(f'''
out = "{out}"
seed = 3
[model]
path = "{model}"
[env]
id = "sleepy_env:tests/Sleepy-v0"
[data]
num_tasks = 64
[agent]
max_context = 256
tools_in_prompt = false
[rollout]
cluster = "local"
num_workers = 1
max_new_tokens = 8
temperature = 1.0
batch_size = 4
group_size = 4
[engine]
device = "cpu"
max_running = 64
[trainer]
steps = {steps}
[trainer.torch]
device = "cpu"
lr = 0.05
pack_sequences = false
[trainer.loss]
preset = "grpo"
[warmup]
steps = 15
batch_size = 16
lr = 0.01
demonstrations = "{tmp / 'demos.jsonl'}"
[eval]
num_tasks = 4
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

    tmp = tmp_path_factory.mktemp("resume")
    (tmp / "sleepy_env.py").write_text(SLEEPY_ENV)
    # a short SFT warm start on replies of varied length: the policy then ends its replies
    # itself, so rewards (and advantages) vary from the first RL step
    replies = ["yes", "no", "a long reply here", "maybe so", "sure thing, friend", "ok"]
    with (tmp / "demos.jsonl").open("w") as f:
        for i in range(64):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": "Say something long."},
                {"role": "assistant", "content": replies[i % len(replies)]}]}) + "\n")
    model = build_model(tmp / "model", "micro")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": f"{tmp}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return tmp, model, env


def _train(config: Path, env: dict, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "palaestra", "train", str(config), *extra],
                          check=False,
                          env=env, capture_output=True, text=True, timeout=300)


def _rl(out: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r for r in rows if r["phase"] == "rl"}


# what follows timing by nature; drift/*: which pooled agent runs the drift check (see report)
_TIMING = ("time/", "perf/", "drift/", "train/step_time_s", "sync/", "time_s",
           "engine/")  # engine/: the scheduler's seconds and calls, which follow arrival times


def _exact(record: dict) -> dict:
    return {k: v for k, v in record.items() if not any(k.startswith(p) for p in _TIMING)}


@pytest.fixture(scope="module")
def runs(setup):
    """An uninterrupted run and one killed with SIGKILL after its step-3 checkpoint, then run
    again; the two start together, so they also compete for the CPU differently."""
    tmp, model, env = setup
    full, killed = tmp / "full", tmp / "killed"
    cmd = [sys.executable, "-m", "palaestra", "train"]
    first = subprocess.Popen([*cmd, str(_config(tmp, full, model))], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    config = _config(tmp, killed, model)
    proc = subprocess.Popen([*cmd, str(config)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    mark = killed / "checkpoints" / "rl-000003" / "COMPLETE"
    deadline = time.time() + 240
    while time.time() < deadline and not mark.exists() and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-2000:]
    assert mark.exists(), "no checkpoint before the kill"
    assert not (killed / "final-model").exists(), "the run finished before it was killed"
    again = _train(config, env)
    assert again.returncode == 0, again.stderr[-2000:]
    return full, killed, out, err


@pytest.mark.slow
def test_a_run_killed_at_a_checkpoint_resumes_exactly(runs):
    full, killed, _, _ = runs
    a, b = _rl(full), _rl(killed)
    assert sorted(b) == list(range(STEPS)), "steps are missing or repeated after the resume"
    assert sum(a[s]["train/grad_norm"] > 0 for s in a) >= STEPS // 2, "too few steps learn"
    for step in range(STEPS):
        x, y = _exact(a[step]), _exact(b[step])
        # the engine's logprobs follow its batch composition at float rounding (~1e-6); the GRPO
        # loss does not use them, this diagnostic does
        for kl in ("train/actor/rollout_kl", "rollout/logprob_max_abs_diff",
                   "rollout/logprob_mean_abs_diff"):  # these diagnostics, likewise
            assert x.pop(kl, 0.0) == pytest.approx(y.pop(kl, 0.0), abs=1e-5)
        assert x == y, (step, {k: (x.get(k), y.get(k)) for k in x if x.get(k) != y.get(k)})
    assert any(a[s]["episodes/failed"] for s in a), "no NaN reward was drawn: the test is weak"
    fa = [json.loads(x) for x in (full / "failures.jsonl").read_text().splitlines()]
    fb = [json.loads(x) for x in (killed / "failures.jsonl").read_text().splitlines()]
    assert fa == fb and all("is not a finite number" in f["error"] for f in fa)


@pytest.mark.slow
def test_the_console_is_kept_and_the_end_gives_the_time_of_each_phase(runs):
    full, killed, out, err = runs
    assert "Writing model shards" not in err and "Loading weights" not in err  # only our bars
    log = (full / "console.log").read_text()
    assert "[eval init]" in log and "[rl step 5]" in log
    done = [line for line in out.splitlines() if line.startswith("[done] total")]
    assert len(done) == 1 and done[0] in log
    for phase in ("init eval", "sft", "rl", "evals"):
        assert phase in done[0]
    timing = json.loads((full / "timing.json").read_text())
    assert timing["total"] >= timing["rl"] + timing["sft"] > 0
    failed = [line for line in log.splitlines() if "episodes failed:" in line]
    records = [json.loads(x) for x in (full / "failures.jsonl").read_text().splitlines()]
    steps = {f["step"] for f in records if f["phase"] == "rl"}
    assert len(failed) == len(steps) > 0  # one line per step with failures
    resumed = (killed / "console.log").read_text()
    assert resumed.count("[palaestra train] starting") == 1
    assert resumed.count("[palaestra train] resuming") == 1


@pytest.mark.slow
def test_other_settings_are_refused_and_more_steps_extend_a_finished_run(runs, setup,
                                                                        monkeypatch):
    from palaestra.config import load_config
    from palaestra.errors import ConfigError
    from palaestra.run.config import TrainConfig
    from palaestra.run.train import train

    tmp, model, _ = setup
    monkeypatch.syspath_prepend(str(tmp))  # the env module, for this process's own run
    full = runs[0]
    before = {p.name: p.read_bytes() for p in full.iterdir() if p.is_file()}
    config = _config(tmp, full, model)
    changed = ["--rollout.batch_size", "8", "--agent.max_context", "128"]
    with pytest.raises(ConfigError) as info:
        train(load_config(TrainConfig, config, changed))
    message = str(info.value)
    assert "rollout.batch_size: 4 -> 8" in message and "agent.max_context: 256 -> 128" in message
    with pytest.raises(ConfigError, match="only be extended"):
        train(load_config(TrainConfig, config, ["--trainer.steps", "3"]))
    after = {p.name: p.read_bytes() for p in full.iterdir() if p.is_file()}
    assert after == before, "a refused run touched its run directory"

    train(load_config(TrainConfig, config, ["--trainer.steps", str(STEPS + 2)]))
    rl = _rl(full)
    assert sorted(rl) == list(range(STEPS + 2))
    assert all(rl[s] == json.loads(x) for s, x in zip(range(STEPS), [
        line for line in before["metrics.jsonl"].decode().splitlines()
        if json.loads(line)["phase"] == "rl"]))  # the first steps stay as they were
    evals = [json.loads(x) for x in (full / "eval.jsonl").read_text().splitlines()]
    assert [e.get("step") for e in evals if e["stage"] == "rl"] == [STEPS, STEPS + 2]
    assert json.loads((full / "config.json").read_text())["trainer"]["steps"] == STEPS + 2


def test_the_console_log_keeps_redrawn_lines_in_their_final_state(tmp_path, capsys):
    from palaestra.run.run_dir import ConsoleLog

    path = tmp_path / "console.log"
    with ConsoleLog(path):
        print("first")
        for i in range(3):  # a progress bar redrawing itself, with a cursor-up escape
            sys.stderr.write(f"\rrl: {i}/3\x1b[A")
        sys.stderr.write("\n")
        print("last")
    assert path.read_text().splitlines() == ["first", "rl: 2/3", "last"]
    assert "first" in capsys.readouterr().out  # the console still gets everything
    with pytest.raises(RuntimeError), ConsoleLog(path):
        raise RuntimeError("boom")
    assert path.read_text().rstrip().endswith("RuntimeError: boom")  # tracebacks are kept too


def test_fixed_settings_are_compared_leaf_by_leaf(tmp_path):
    from palaestra.errors import ConfigError
    from palaestra.run.config import TrainConfig
    from palaestra.run.train import _resolved
    from palaestra.run.run_dir import check_resume

    def dump(**changes) -> dict:
        return json.loads(TrainConfig(out=str(tmp_path), **changes).model_dump_json())

    recorded = dump()
    del recorded["rollout"]["over_sampling"]  # a field this version added since the run began
    (tmp_path / "config.json").write_text(json.dumps(recorded))
    (tmp_path / "state.json").write_text('{"phase": "rl", "step": 3}')
    check_resume(tmp_path, dump(), normalize=_resolved)  # the new field at its default: fine
    check_resume(tmp_path, dump(trainer={"steps": 50}, logging={"progress": False}),
                 normalize=_resolved)  # free settings
    with pytest.raises(ConfigError) as info:
        check_resume(tmp_path, dump(env={"kwargs": {"max_value": 9}}, seed=1),
                     normalize=_resolved)
    assert "env.kwargs.max_value: '(unset)' -> 9" in str(info.value)
    assert "seed: 0 -> 1" in str(info.value)

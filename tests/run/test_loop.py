"""The training loop end to end on CPU: GRPO steps, weight sync, warm start, resume after kill -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from palaestra.config import load_config
from palaestra.run.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]

YES_NO_ENV = '''
"""Say yes: reward 1 when the reply contains "yes" (an easy RL target for tests)."""
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


class LongEnv(YesEnv):
    """Reward grows with the reply's length: random replies differ, so advantages are non-zero."""

    def on_action(self, action):
        return StepResult(reward=min(len(action.content), 40) / 40, terminated=True)


envs.register("tests/Yes-v0", entry_point=YesEnv)
envs.register("tests/Long-v0", entry_point=LongEnv)
'''


def _write_config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(body)
    return path


def _base(tmp_path: Path, model_dir: Path) -> str:
    return f'''
out = "{tmp_path / "run"}"
seed = 0
[model]
path = "{model_dir}"
[agent]
max_context = 256
tools_in_prompt = false
[rollout]
cluster = "local"
num_workers = 1
max_new_tokens = 8
temperature = 1.0
[engine]
device = "cpu"
max_running = 64
[trainer.torch]
device = "cpu"
pack_sequences = false
[checkpoint]
interval = 1
keep_last = 2
[logging]
progress = false
tensorboard = false
'''


def _grpo_on_long_env(tmp_path: Path, model_dir: Path, steps: int, engine: str | None = None,
                      extra: str = "") -> str:
    """A GRPO run of ``steps`` on tests/Long-v0; ``engine`` replaces the [engine] section."""
    body = _base(tmp_path, model_dir) + f'''
[env]
id = "yes_env:tests/Long-v0"
[data]
num_tasks = 64
[trainer]
steps = {steps}
[trainer.loss]
preset = "grpo"
''' + extra
    if engine is not None:
        local = '[engine]\ndevice = "cpu"\nmax_running = 64'
        assert local in body  # the section _base writes, replaced whole
        body = body.replace(local, "[engine]\n" + engine)
    return body


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory):
    from palaestra.tiny_model import build_model

    return build_model(tmp_path_factory.mktemp("micro") / "model", "micro")


@pytest.fixture()
def yes_env(tmp_path, monkeypatch):
    (tmp_path / "yes_env.py").write_text(YES_NO_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    import importlib

    importlib.import_module("yes_env")
    return "yes_env:tests/Yes-v0"


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_three_grpo_steps_change_weights_and_bump_engine_version(tmp_path, micro_model, yes_env):
    from safetensors.torch import load_file

    from palaestra.run.train import train

    body = _grpo_on_long_env(tmp_path, micro_model, steps=3)
    overrides = ["--rollout.batch_size", "4", "--rollout.group_size", "4", "--eval.num_tasks", "4",
                 "--trainer.torch.lr", "0.05"]
    cfg = load_config(TrainConfig, _write_config(tmp_path, body), overrides)
    result = train(cfg)
    run = tmp_path / "run"
    rl = [r for r in _read(run / "metrics.jsonl") if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1, 2]
    assert [r["version"] for r in rl] == [0, 1, 2]  # each batch sampled by the newest weights
    assert all(r["train/num_loss_tokens"] > 0 for r in rl)
    before = load_file(str(micro_model / "model.safetensors"))
    after = load_file(str(run / "checkpoints" / "rl-000003" / "model.safetensors"))
    changed = [k for k in before if k in after and not (before[k] == after[k]).all()]
    assert changed, "training did not change any weight"
    assert set(result) == {"init", "rl"}
    assert (run / "curves.png").stat().st_size > 0 and (run / "config.json").exists()


def test_warm_start_then_rl_raises_reward(tmp_path, micro_model, yes_env):
    """SFT on 30% "yes" demonstrations, then GRPO: the reward mean must go up."""
    demos = tmp_path / "demos.jsonl"
    with demos.open("w") as f:
        for i in range(100):
            reply = "yes" if i % 10 < 3 else "no"
            f.write(json.dumps({"messages": [{"role": "user", "content": "Say yes or no."},
                                             {"role": "assistant", "content": reply}]}) + "\n")
    from palaestra.run.train import train

    cfg = load_config(TrainConfig, _merge(tmp_path, micro_model, yes_env, demos))
    result = train(cfg)
    rl = [r for r in _read(tmp_path / "run" / "metrics.jsonl") if r["phase"] == "rl"]
    first, last = rl[0]["reward_mean"], sum(r["reward_mean"] for r in rl[-2:]) / 2
    assert first < 0.6, f"the warm start should leave room to improve (first reward {first})"
    assert last > first + 0.2, f"reward did not go up: {[round(r['reward_mean'], 2) for r in rl]}"
    assert result["rl"] > result["sft"]


def _merge(tmp_path: Path, model: Path, env_id: str, demos: Path) -> Path:
    text = f'''
out = "{tmp_path / "run"}"
seed = 0
[model]
path = "{model}"
[env]
id = "{env_id}"
[data]
num_tasks = 256
[agent]
max_context = 256
tools_in_prompt = false
[warmup]
steps = 40
batch_size = 32
lr = 0.01
demonstrations = "{demos}"
[rollout]
cluster = "local"
num_workers = 1
max_new_tokens = 8
batch_size = 8
group_size = 8
[engine]
device = "cpu"
[trainer]
steps = 8
[trainer.torch]
device = "cpu"
lr = 0.002
pack_sequences = false
[trainer.loss]
preset = "grpo"
[eval]
num_tasks = 64
[checkpoint]
interval = 4
[logging]
progress = false
tensorboard = false
'''
    return _write_config(tmp_path, text)


def test_sft_resumes_after_kill_with_the_same_next_loss(tmp_path, micro_model):
    demos = tmp_path / "sft.jsonl"
    with demos.open("w") as f:
        for i in range(64):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"count {i}"},
                                             {"role": "assistant", "content": f"{i} {i + 1}"}]}) + "\n")

    def config(out: Path) -> Path:
        return _write_config(out.parent, f'''
algorithm = "sft"
out = "{out}"
[model]
path = "{micro_model}"
[offline]
dataset = "{demos}"
batch_size = 8
[trainer]
steps = 40
[trainer.torch]
device = "cpu"
lr = 0.001
pack_sequences = false
[checkpoint]
interval = 5
[logging]
progress = false
tensorboard = false
''')

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full = tmp_path / "full" / "run"
    full.parent.mkdir()
    cmd = [sys.executable, "-m", "palaestra", "train"]
    subprocess.run([*cmd, str(config(full))], check=True, env=env, capture_output=True)
    killed = tmp_path / "killed" / "run"
    killed.parent.mkdir()
    proc = subprocess.Popen([*cmd, str(config(killed))], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not (killed / "checkpoints" / "sft-000010" / "COMPLETE").exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (killed / "checkpoints" / "sft-000010" / "COMPLETE").exists(), "no checkpoint before the kill"
    assert not (killed / "final-model").exists(), "the run finished before it was killed"
    subprocess.run([*cmd, str(config(killed))], check=True, env=env, capture_output=True)
    a = {r["step"]: r["loss"] for r in _read(full / "metrics.jsonl")}
    b = {r["step"]: r["loss"] for r in _read(killed / "metrics.jsonl")}
    assert sorted(b) == list(range(40)), "steps are missing or repeated after the resume"
    assert b == a  # bit-identical losses, including the steps after the resume


@pytest.mark.parametrize("method", ["distributed", "disk"])
def test_grpo_against_a_separate_server_process(tmp_path, micro_model, yes_env, method):
    """engine.kind = "sglang": a `palaestra serve` process rolls out; the weights reach it after
    every step over SGLang's weight-update group (gloo here, NCCL on GPUs) or through disk."""
    import asyncio

    import torch
    from safetensors.torch import load_file

    from palaestra.engines.serve.serve import serve_process
    from palaestra.engines.clients.sglang_client import SGLangClient
    from palaestra.run.train import train

    demos = tmp_path / "demos.jsonl"  # a short warm start: its policy reaches the server too
    demos.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": "Say yes or no."},
        {"role": "assistant", "content": "yes"}]}) + "\n" for _ in range(8)))
    server = serve_process(micro_model, device="cpu", extra=("--threads", "1"),
                           log_path=tmp_path / "serve.log")
    try:
        asyncio.run(server.wait_ready(120))
        body = _grpo_on_long_env(tmp_path, micro_model, steps=2, engine=f'''kind = "sglang"
urls = ["{server.url}"]
weight_sync = {{ kind = "{method}", bucket_mb = 1{', backend = "gloo"' if method == "distributed" else ""} }}''', extra=f'''[warmup]
steps = 2
batch_size = 4
demonstrations = "{demos}"
''')
        overrides = ["--rollout.batch_size", "4", "--rollout.group_size", "2",
                     "--eval.num_tasks", "4", "--trainer.torch.lr", "0.05"]
        train(load_config(TrainConfig, _write_config(tmp_path, body), overrides))
        run = tmp_path / "run"
        rl = [r for r in _read(run / "metrics.jsonl") if r["phase"] == "rl"]
        assert [r["version"] for r in rl] == [0, 1]
        assert all(r["sync/seconds"] > 0 and r["sync/buckets"] >= 1 for r in rl)
        if method == "distributed":
            assert all(r["sync/unflushed_servers"] == 0 for r in rl)
        final = load_file(str(run / "checkpoints" / "rl-000002" / "model.safetensors"))

        async def served() -> tuple[dict, dict[str, torch.Tensor]]:
            client = SGLangClient(server.url, retries=0)
            try:
                names = ["model.layers.0.mlp.down_proj.weight", "model.norm.weight"]
                got = {n: torch.tensor(await client.get_weights_by_name(n, 3)) for n in names}
                return await client.get_model_info(), got
            finally:
                await client.close()

        info, got = asyncio.run(served())
        assert info["weight_version"] == "2"  # the version after the last step's push
        assert [e["stage"] for e in _read(run / "eval.jsonl")] == ["init", "sft", "rl"]
        for name, values in got.items():
            torch.testing.assert_close(values, final[name][:3].float(), rtol=0, atol=0)
    finally:
        server.stop()


def test_the_run_launches_its_own_server_and_stops_it(tmp_path, micro_model, yes_env):
    """engine.launch = "palaestra": the run starts `palaestra serve` in its own process, rolls
    out through it, syncs the weights over a gloo weight-update group and stops it at the end."""
    import socket

    from palaestra.run.train import train

    body = _grpo_on_long_env(tmp_path, micro_model, steps=2, engine='''kind = "sglang"
launch = "palaestra"
launch_args = ["--threads", "1"]
weight_sync = { kind = "distributed", backend = "gloo" }''')
    overrides = ["--rollout.batch_size", "4", "--rollout.group_size", "2", "--eval.num_tasks", "4"]
    train(load_config(TrainConfig, _write_config(tmp_path, body), overrides))
    run = tmp_path / "run"
    rl = [r for r in _read(run / "metrics.jsonl") if r["phase"] == "rl"]
    assert [r["version"] for r in rl] == [0, 1] and all(r["sync/seconds"] > 0 for r in rl)
    (log,) = (run / "servers").glob("*.log")
    port = int(log.stem.rsplit("-", 1)[1])
    with socket.socket() as s:  # the server is gone with the run
        assert s.connect_ex(("127.0.0.1", port)) != 0


def _dpo_rows(path: Path, n: int = 32) -> Path:
    """Preference pairs with an easy rule: the chosen reply repeats the number, the rejected
    one does not."""
    with path.open("w") as f:
        for i in range(n):
            prompt = [{"role": "user", "content": f"repeat {i}"}]
            f.write(json.dumps({"prompt": prompt,
                                "chosen": [{"role": "assistant", "content": f"{i}"}],
                                "rejected": [{"role": "assistant", "content": "no"}]}) + "\n")
    return path


def dpo_config(tmp_path: Path, model: Path, dataset: Path, *, steps: int = 6) -> str:
    return f'''
algorithm = "dpo"
out = "{tmp_path / "run"}"
[model]
path = "{model}"
[offline]
dataset = "{dataset}"
batch_size = 8
[trainer]
steps = {steps}
[trainer.torch]
device = "cpu"
lr = 0.002
[trainer.loss]
preset = "dpo"
dpo_beta = 0.5
[checkpoint]
interval = 3
[logging]
progress = false
tensorboard = false
'''


def test_dpo_run_learns_the_preference_and_exports(tmp_path, micro_model):
    from palaestra.run.train import train

    dataset = _dpo_rows(tmp_path / "pairs.jsonl")
    path = _write_config(tmp_path, dpo_config(tmp_path, micro_model, dataset))
    train(load_config(TrainConfig, path))
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    dpo = [r for r in records if r["phase"] == "dpo"]
    assert [r["step"] for r in dpo] == list(range(6))
    assert dpo[-1]["loss"] < dpo[0]["loss"] < 0.7  # log(2) at the start: policy == reference
    assert dpo[-1]["train/dpo/reward_margin"] > 0
    assert (run / "final-model" / "config.json").exists()


def test_a_step_with_non_finite_gradients_is_counted_as_skipped(micro_model):
    import torch

    from palaestra.trainers.algorithms.config import LossConfig
    from palaestra.trainers.batching import TrainBatch
    from palaestra.trainers.ppo.step import update_skipped as _update_skipped
    from palaestra.trainers.torch_backend.backend import TorchBackend
    from palaestra.trainers.torch_backend.config import TorchBackendConfig

    torch.set_num_threads(1)
    backend = TorchBackend(micro_model, TorchBackendConfig(device="cpu", lr=0.01))

    def batch(advantage: float) -> TrainBatch:
        ids = [torch.arange(10, 20), torch.arange(30, 36)]
        masks = [torch.tensor([0.0] * 3 + [1.0] * (len(t) - 3)) for t in ids]
        return TrainBatch(token_ids=ids, loss_mask=masks, group_ids=["a", "a"],
                          advantages=[m * advantage for m in masks])

    before = {k: v.clone() for k, v in backend.model.state_dict().items()}
    metrics = backend.train_step(batch(float("nan")), LossConfig(preset="grpo"))
    assert _update_skipped(metrics)  # the backend skipped the optimizer step: the loop counts it
    assert all(torch.equal(before[k], v) for k, v in backend.model.state_dict().items())
    assert not _update_skipped(backend.train_step(batch(1.0), LossConfig(preset="grpo")))
    assert _update_skipped({"grad_norm": 0.5, "update_ok": 0.0})  # Megatron's report


def test_a_run_whose_prompts_exceed_the_context_goes_on(tmp_path, micro_model):
    """Groups in which every prompt was truncated before its first token have no policy
    version: they are not stale at the next step (they were requeued for ever, and the run
    failed at step 1 with "no group could be kept")."""
    from palaestra.run.train import train

    body = _base(tmp_path, micro_model) + '''
[env]
id = "palaestra/Calculator-v0"
[trainer]
steps = 3
[eval]
num_tasks = 0
'''
    cfg = load_config(TrainConfig, _write_config(tmp_path, body),
                      ["--rollout.batch_size", "2", "--rollout.group_size", "2",
                       "--agent.max_context", "48"])
    train(cfg)
    rl = [r for r in _read(tmp_path / "run" / "metrics.jsonl") if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1, 2]
    assert all(r["stop_reason/truncated"] == 4 and r["train/num_loss_tokens"] == 0 for r in rl)

"""Engines as Ray actors on the plan's engine bundles: `EngineGroup` on a real Ray cluster with
real ``palaestra serve`` children on loopback, the ``[placement]`` checks that refuse bad
combinations at load time, and whole ``palaestra train`` runs whose ``[placement]`` asks for
engines (two actors serve and hold the final weights; a killed actor's requests go to the
other and the run finishes)."""

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
from palaestra.errors import ConfigError
from palaestra.run.fleet.placement import PlacementSection, plan_run
from palaestra.run.config import TrainConfig

pytest.importorskip("ray")

FAST_ENV = '''
"""A reward for longer replies; ``SLEEP_S`` per episode reset (so a run's steps take a while),
and no reset at all while the file ``HOLD_FILE`` names exists (a test holds the run still)."""
import os
import time

import palaestra.envs as envs
from palaestra.envs import Env, StepResult
from palaestra.types import Message


class LongEnv(Env):
    def sample_task(self, rng):
        return {"id": int(rng.integers(1_000_000)), "question": "Say yes or no."}

    def initial_messages(self, task):
        time.sleep(float(os.environ.get("SLEEP_S", "0")))
        hold = os.environ.get("HOLD_FILE")
        while hold and os.path.exists(hold):
            time.sleep(0.02)
        return [Message("user", task["question"])]

    def on_action(self, action):
        return StepResult(reward=min(len(action.content), 40) / 40, terminated=True)


envs.register("tests/EngineActorsLong-v0", entry_point=LongEnv)
'''


def run_config(tmp_path: Path, model: Path, *, steps: int, engines: int, cluster: str = "local",
               extra: str = "") -> Path:
    """A short RL run on the micro model whose [placement] asks for ``engines`` CPU engines."""
    body = f'''
out = "{tmp_path / "run"}"
seed = 0
[model]
path = "{model}"
[agent]
max_context = 256
tools_in_prompt = false
[env]
id = "actors_env:tests/EngineActorsLong-v0"
[data]
num_tasks = 64
[eval]
num_tasks = 2
[rollout]
cluster = "{cluster}"
num_workers = 1
worker_num_cpus = 0.25
max_new_tokens = 8
batch_size = 4
group_size = 2
[engine]
kind = "local"
launch_args = ["--threads", "1"]
[trainer]
steps = {steps}
[trainer.loss]
preset = "grpo"
[trainer.torch]
device = "cpu"
pack_sequences = false
lr = 0.05
[checkpoint]
interval = {steps}
[logging]
progress = false
tensorboard = false
[placement]
gpus_per_node = 0
engines = {engines}
cpus_per_engine = 0.25
{extra}
'''
    (tmp_path / "actors_env.py").write_text(FAST_ENV)
    path = tmp_path / "run.toml"
    path.write_text(body)
    return path


def start_run(tmp_path: Path, config: Path, sleep_s: float = 0.0,
              hold_file: Path | None = None) -> subprocess.Popen[str]:
    """``palaestra train config``; its env sleeps ``sleep_s`` per reset and resets nothing while
    ``hold_file`` exists."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "SLEEP_S": str(sleep_s), "HOLD_FILE": str(hold_file or ""),
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen([sys.executable, "-m", "palaestra", "train", str(config)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(path: Path, proc: subprocess.Popen[str], timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before writing {path}:\n"
                                 + (proc.stdout.read() if proc.stdout else ""))
        assert time.monotonic() < deadline, f"no {path} after {timeout_s} s"
        time.sleep(0.05)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def gone(pid: int, timeout_s: float = 15.0) -> bool:
    """Whether process ``pid`` has ended (a zombie counts: it runs nothing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory) -> Path:
    from palaestra.tiny_model import build_model

    return build_model(tmp_path_factory.mktemp("engine-actors") / "model", "micro")


# ----------------------------------------------------------------------------- the plan
def test_cpu_engines_get_bundles_of_their_own():
    plan = plan_run(PlacementSection(gpus_per_node=0, trainer_ranks=2, engines=2,
                                     cpus_per_engine=0.5), on_gpu=False)
    assert plan.trainer_bundles == (0, 1) and plan.engine_bundles == ((2,), (3,))
    assert plan.bundles[2:] == ({"CPU": 0.5}, {"CPU": 0.5}) and plan.engine_gpu_fraction == 0
    assert "bundle 3 [CPU 0.5]: engine 1" in "\n".join(plan.describe_lines())
    gpu = plan_run(PlacementSection(gpus_per_node=4, trainer_ranks=2, engine_gpus=2),
                   on_gpu=True)
    assert gpu.engine_bundles == ((2,), (3,)) and gpu.engine_gpu_fraction == 1.0


def test_bad_combinations_are_refused_when_the_config_loads(tmp_path, micro_model, monkeypatch):
    config = run_config(tmp_path, micro_model, steps=1, engines=2)
    monkeypatch.syspath_prepend(str(tmp_path))  # the env module, as PYTHONPATH gives the runs
    cfg = load_config(TrainConfig, config)
    from palaestra.run.dry_run import describe_plan
    from palaestra.run.fleet.start import engine_actor_count

    assert engine_actor_count(cfg) == 2
    text = describe_plan(cfg, environ={})
    assert "engines: 2 Ray actor(s), each serving palaestra serve on its CPU bundle(s)" in text
    assert "engine actor 1: bundles [2]" in text and "weight sync: distributed if CUDA" in text
    cases = [
        (["--engine.urls", '["http://127.0.0.1:30000"]', "--engine.kind", "sglang"],
         "engine.urls / engine.launch name engines too"),
        (["--engine.kind", "sglang", "--engine.launch", "palaestra"], "keep one of them"),
        (["--engine.kind", "sglang"], "SGLang needs GPUs"),
        (["--engine.weight_sync.kind", "in_process"], "the weights cannot go in process"),
        (["--placement.engines", "2", "--placement.gpus_per_node", "8",
          "--trainer.torch.device", "cuda", "--placement.engine_gpus", "2"],
         "on GPU nodes the engines are placement.engine_gpus / engine_tp"),
        (["--placement.engines", "0", "--placement.gpus_per_node", "8", "--trainer.torch.device",
          "cuda", "--placement.engine_gpus", "4", "--placement.engine_tp", "2"],
         "the embedded engine (engine.kind = 'local') serves on one GPU"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_config(TrainConfig, config, overrides)
    # GPU engines with SGLang: planned with their flags (the node's sglang is checked at start)
    gpu = load_config(TrainConfig, config, [
        "--placement.engines", "0", "--placement.gpus_per_node", "8", "--trainer.torch.device",
        "cuda", "--placement.engine_gpus", "4", "--placement.engine_tp", "2", "--engine.kind",
        "sglang", "--placement.model_shape", "qwen3-0.6b"])
    text = describe_plan(gpu, environ={})
    assert "engines: 2 Ray actor(s), each serving sglang.launch_server" in text
    assert "engine actor 1: bundles [3, 4] --tp-size 2" in text


def test_sglang_command_line_follows_its_cli():
    from palaestra.run.fleet.engine_actor import EngineLaunch, server_argv

    argv = server_argv(EngineLaunch("/models/q", server="sglang", colocate=True),
                       host="10.0.0.2", port=30001, gpus=2)
    assert argv[1:] == ["-m", "sglang.launch_server", "--model-path", "/models/q", "--tp-size",
                        "2", "--host", "10.0.0.2", "--port", "30001", "--enable-memory-saver",
                        "--mem-fraction-static", "0.45"]
    plain = server_argv(EngineLaunch("/m", extra_args=("--threads", "1")), host="127.0.0.1",
                        port=5, gpus=0)
    assert plain[1:] == ["-m", "palaestra", "serve", "--model", "/m", "--host", "127.0.0.1",
                         "--port", "5", "--device", "cpu", "--threads", "1"]


# --------------------------------------------------------------- the group on real Ray
async def test_engine_group_starts_serves_and_loses_a_killed_actor(ray_cluster, micro_model,
                                                                   tmp_path):
    """Two CPU engine actors; killing one takes its server down (a lost server: the router
    retries on the other); an added one starts in its own placement group; close ends all."""
    from dataclasses import replace

    from palaestra.engine import SamplingParams
    from palaestra.errors import MissingExtraError
    from palaestra.run.fleet.actors import ActorEngine, EngineGroup
    from palaestra.run.fleet.engine_actor import EngineLaunch

    ray = ray_cluster
    plan = plan_run(PlacementSection(gpus_per_node=0, trainer_ranks=1, engines=2,
                                     cpus_per_engine=0.25), on_gpu=False)
    group = EngineGroup(EngineLaunch(str(micro_model), extra_args=("--threads", "1"),
                                     log_dir=str(tmp_path), cpus_per_engine=0.25))
    urls = await group.start(plan)
    engine = ActorEngine(group, health_interval_s=0)
    await engine.start()
    try:
        assert len(urls) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls)
        assert [m.index for m in group.members] == [0, 1]
        short = SamplingParams(max_new_tokens=4)
        served = {(await engine.generate([1, 2, 3], short)).meta["engine"] for _ in range(4)}
        assert served == set(urls)  # least-loaded routing reaches both
        first = group.members[0]
        ray.kill(first.actor)
        assert gone(first.server_pid), "the server outlived its actor"
        assert await group.alive() == {urls[0]: False, urls[1]: True}
        after = [(await engine.generate([1, 2, 3], short)).meta["engine"] for _ in range(3)]
        assert after == [urls[1]] * 3  # retried on the engine left
        from palaestra.errors import EngineError

        with pytest.raises(ConfigError, match="serves on one GPU"):
            await group.add(2)
        with pytest.raises(EngineError, match="has 0 free GPUs"):
            await group.add(1)
        added = await group.add(0)
        assert added.placement_group is not None and added.url not in urls
        await group.remove(added.url)
        assert gone(added.server_pid) and added.url not in group.urls
        sglang = EngineGroup(replace(group.launch, server="sglang"))
        one = plan_run(PlacementSection(gpus_per_node=0, engines=1, cpus_per_engine=0.25),
                       on_gpu=False)
        with pytest.raises(MissingExtraError, match="sglang"):  # not importable on this node
            await sglang.start(one)
    finally:
        servers = [m.server_pid for m in group.members]
        await engine.close()
    assert group.members == [] and all(gone(pid) for pid in servers)
    assert ray.is_initialized()  # the session's cluster: not the group's to stop


# ----------------------------------------------------------------------- whole runs
@pytest.mark.slow
def test_a_run_with_two_engine_actors(tmp_path, micro_model):
    steps = 2
    proc = start_run(tmp_path, run_config(tmp_path, micro_model, steps=steps, engines=2))
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out
    run = tmp_path / "run"
    assert out.count("(palaestra, no GPU) serves on http://127.0.0.1:") == 2, out
    final = json.loads((run / "engines.json").read_text())
    urls = [a["url"] for a in final["actors"]]
    assert len(urls) == 2 and sorted(e["name"] for e in final["engines"]) == sorted(urls)
    assert final["served_versions"] == {u: str(steps) for u in urls}  # the final weights
    rl = [r for r in read_jsonl(run / "metrics.jsonl") if r["phase"] == "rl"]
    assert [r["version"] for r in rl] == list(range(steps))
    assert all(r["staleness/max"] == 0 for r in rl)  # both served each step's weights
    assert all(rl[-1][f"engines/requests/{u}"] > 0 for u in urls)  # both served
    assert rl[-1]["engines/count"] == 2 and rl[-1]["engines/lost"] == 0
    assert all(gone(a["server_pid"]) and gone(a["actor_pid"]) for a in final["actors"])


@pytest.mark.slow
def test_a_killed_engine_actor_is_a_lost_server(tmp_path, micro_model):
    from palaestra.run.engines_cli import call

    steps = 3
    proc = start_run(tmp_path, run_config(tmp_path, micro_model, steps=steps, engines=2),
                     sleep_s=0.3)
    run = tmp_path / "run"
    try:
        wait_for(run / "admin.json", proc)
        listed = call(run, "list")
        victim = listed["actors"][0]
        metrics = run / "metrics.jsonl"
        while not metrics.exists() or not any(r.get("phase") == "rl"
                                              for r in read_jsonl(metrics)):
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.05)
        os.kill(victim["actor_pid"], signal.SIGKILL)  # the actor's process dies mid-run
        assert gone(victim["server_pid"])
        out, _ = proc.communicate(timeout=400)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert f"{victim['url']} stopped answering: dropped from the run" in out
    rl = [r for r in read_jsonl(run / "metrics.jsonl") if r["phase"] == "rl"]
    assert len(rl) == steps and rl[-1]["engines/lost"] == 1 and rl[-1]["engines/count"] == 1
    survivor = next(a["url"] for a in listed["actors"] if a["url"] != victim["url"])
    lost, kept = f"engines/requests/{victim['url']}", f"engines/requests/{survivor}"
    # killed as step 1 began: it served a few of step 1's requests at most, the other the rest
    # of steps 1 and 2 (4 groups x 2 episodes each), those in flight on the dead one included
    more_lost, more_kept = rl[-1].get(lost, 0) - rl[0].get(lost, 0), rl[-1][kept] - rl[0][kept]
    assert more_lost < 8 and more_lost + more_kept >= 2 * 4 * 2
    assert not (run / "failures.jsonl").exists() or not read_jsonl(run / "failures.jsonl")
    final = json.loads((run / "engines.json").read_text())
    left = [a["url"] for a in final["actors"]]
    assert victim["url"] not in left and final["served_versions"] == {left[0]: str(steps)}


# ---------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
async def test_a_gpu_engine_actor_serves_on_its_bundles_gpu(micro_model, tmp_path):
    """One GPU, colocated plan (the engine asks half of it): the actor finds its bundle's GPU
    id, pins ``palaestra serve --device cuda`` to it, and the server generates on CUDA."""
    import ray

    from palaestra.engine import SamplingParams
    from palaestra.run.fleet.actors import ActorEngine, EngineGroup
    from palaestra.run.fleet.engine_actor import EngineLaunch
    from palaestra.engines.clients.sglang_client import SGLangClient

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, num_gpus=1, include_dashboard=False)
    try:
        plan = plan_run(PlacementSection(gpus_per_node=1, trainer_ranks=1, engine_gpus=1,
                                         colocate=True), on_gpu=True)
        assert plan.engine_gpu_fraction == 0.5
        group = EngineGroup(EngineLaunch(str(micro_model), colocate=True, log_dir=str(tmp_path)))
        engine = ActorEngine(group, health_interval_s=0)
        await group.start(plan)
        await engine.start()
        try:
            gen = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
            assert len(gen.token_ids) == 4
            client = SGLangClient(group.urls[0])
            info = await client.get_server_info()
            await client.close()
            assert info["device"].startswith("cuda"), info
        finally:
            await engine.close()
    finally:
        if started:
            ray.shutdown()

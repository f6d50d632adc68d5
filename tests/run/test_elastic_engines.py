"""Elastic engines, with real `palaestra serve` processes on loopback: an engine added to a
running `palaestra train` serves the next step at the current weight version, a removed one
drains, and the `palaestra engines` command's errors say what is wrong."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

SLOW_ENV = '''
"""A reward for longer replies; each episode's step sleeps so that the steps take a while."""
import time

import palaestra.envs as envs
from palaestra.envs import Env, StepResult
from palaestra.types import Message


class SlowLongEnv(Env):
    def sample_task(self, rng):
        return {"id": int(rng.integers(1_000_000)), "question": "Say yes or no."}

    def initial_messages(self, task):
        return [Message("user", task["question"])]

    def on_action(self, action):
        time.sleep(0.4)
        return StepResult(reward=min(len(action.content), 40) / 40, terminated=True)


envs.register("tests/SlowLong-v0", entry_point=SlowLongEnv)
'''


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory):
    from palaestra.tiny_model import build_model

    return build_model(tmp_path_factory.mktemp("elastic") / "model", "micro")


@pytest.fixture(scope="module")
def servers(micro_model, tmp_path_factory):
    """Two `palaestra serve` processes of the micro model."""
    from palaestra.rollout.testing import serve_processes

    with serve_processes(micro_model, 2, tmp_path_factory.mktemp("serve-logs")) as procs:
        yield procs


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _config(tmp_path: Path, model: Path, url: str, steps: int) -> Path:
    body = f'''
out = "{tmp_path / "run"}"
seed = 0
[model]
path = "{model}"
[agent]
max_context = 256
tools_in_prompt = false
[env]
id = "slow_env:tests/SlowLong-v0"
[data]
num_tasks = 64
[eval]
num_tasks = 2
[rollout]
cluster = "local"
num_workers = 1
max_new_tokens = 8
temperature = 1.0
batch_size = 4
group_size = 2
[engine]
kind = "sglang"
urls = ["{url}"]
[engine.weight_sync]
kind = "distributed"
backend = "gloo"
bucket_mb = 1
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
'''
    path = tmp_path / "run.toml"
    path.write_text(body)
    return path


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before writing {path}:\n"
                                 + proc.stdout.read())
        assert time.monotonic() < deadline, f"no {path} after {timeout_s} s"
        time.sleep(0.05)


def test_an_engine_joins_a_running_run_and_one_drains_out(tmp_path, micro_model, servers):
    import torch
    from safetensors.torch import load_file

    from palaestra.errors import ConfigError, EngineError
    from palaestra.engines.clients.sglang_client import SGLangClient
    from palaestra.run.engines_cli import call

    a, b = servers
    steps = 4
    (tmp_path / "slow_env.py").write_text(SLOW_ENV)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "palaestra", "train",
                             str(_config(tmp_path, micro_model, a.url, steps))],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(run / "admin.json", proc)
        assert (os.stat(run / "admin.token").st_mode & 0o777) == 0o600
        admin = json.loads((run / "admin.json").read_text())["url"]
        with pytest.raises(urllib.error.HTTPError) as refused:  # no token: no answer
            urllib.request.urlopen(admin + "/engines", timeout=30)
        assert refused.value.code == 401
        # errors while the run is there: each says what is wrong
        with pytest.raises(EngineError, match="already serves this run"):
            call(run, "add", a.url)
        with pytest.raises(ConfigError, match="not an engine URL"):
            call(run, "add", "localhost:1234")
        with pytest.raises(EngineError, match="no engine answers"):
            call(run, "add", "http://127.0.0.1:9")
        with pytest.raises(EngineError, match="only engine"):
            call(run, "remove", a.url)

        joined = call(run, "add", b.url)  # returns once b serves, at the next step boundary
        assert joined["url"] == b.url and joined["version"] == joined["step"] < steps - 1
        listed = call(run, "list")
        assert {e["name"]: e["weight_version"] for e in listed["engines"]} == {
            a.url: joined["version"], b.url: joined["version"]}
        drained = call(run, "remove", a.url, timeout_s=30)
        assert drained["name"] == a.url and drained["retried"] == 0
        assert drained["finished"] == drained["in_flight"]
        assert [e["name"] for e in call(run, "list")["engines"]] == [b.url]
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert f"{b.url} joined at weight version {joined['version']}" in out
    assert not (run / "admin.json").exists() and not (run / "admin.token").exists()
    with pytest.raises(ConfigError, match="no running run"):
        call(run, "list")

    rl = [r for r in _read(run / "metrics.jsonl") if r["phase"] == "rl"]
    assert [r["version"] for r in rl] == list(range(steps))  # every batch at the policy's version
    req_a, req_b = f"engines/requests/{a.url}", f"engines/requests/{b.url}"
    served_b = [r.get(req_b, 0.0) for r in rl]
    # b served nothing before it joined, and requests in the step it joined at (its version)
    assert all(n == 0 for n in served_b[:joined["step"]])
    first = joined["step"]
    assert served_b[first] > (served_b[first - 1] if first else 0)
    # after the removal (during step `first` or the next), a serves nothing new
    assert rl[-1][req_a] == rl[-2][req_a] and rl[-1][req_b] > rl[-2][req_b]
    assert rl[-1]["engines/added"] == 1 and rl[-1]["engines/removed"] == 1
    assert rl[-1]["engines/count"] == 1 and rl[-1]["engines/lost"] == 0

    # b holds the final weights at the final version
    final = load_file(str(run / "checkpoints" / f"rl-{steps:06d}" / "model.safetensors"))

    async def served() -> tuple[dict, torch.Tensor]:
        client = SGLangClient(b.url, retries=0)
        try:
            name = "model.layers.0.mlp.down_proj.weight"
            return (await client.get_model_info(),
                    torch.tensor(await client.get_weights_by_name(name, 3)))
        finally:
            await client.close()

    info, got = asyncio.run(served())
    assert info["weight_version"] == str(steps)
    torch.testing.assert_close(got, final["model.layers.0.mlp.down_proj.weight"][:3].float(),
                               rtol=0, atol=0)


async def test_drain_lets_in_flight_finish_or_moves_them_after_the_timeout(servers):
    from palaestra.engine import SamplingParams
    from palaestra.engines.clients.router import Router
    from palaestra.engines.clients.sglang_client import SGLangClient

    a, b = servers
    for timeout_s, moved, tokens in ((60.0, False, 48), (0.05, True, 400)):
        long = SamplingParams(max_new_tokens=tokens, temperature=1.0, ignore_eos=True)
        clients = [SGLangClient(a.url), SGLangClient(b.url)]
        router = Router(clients, health_interval_s=0)
        try:
            tasks = [asyncio.ensure_future(router.generate([1, 2, 3], long, request_id=f"r{i}"))
                     for i in range(8)]
            while sum(s["outstanding"] for s in router.status()) < 8:
                await asyncio.sleep(0.005)
            result = await router.drain_engine(a.url, timeout_s=timeout_s)
            gens = await asyncio.gather(*tasks)
            assert all(len(g.token_ids) == tokens for g in gens)  # every request completed
            assert result["in_flight"] > 0
            assert [s["name"] for s in router.status()] == [b.url]
            m = router.metrics()
            assert m["engines/removed"] == 1 and m["engines/added"] == 0
            assert m[f"engines/requests/{a.url}"] + m[f"engines/requests/{b.url}"] == 8
            if moved:  # cancelled on a, run again on b
                assert result["retried"] > 0 and m["engines/retried"] == result["retried"]
            else:
                assert result["retried"] == 0 and result["finished"] == result["in_flight"]
                assert m[f"engines/requests/{a.url}"] == result["in_flight"]
            extra = await router.generate([1, 2], SamplingParams(max_new_tokens=2))
            assert extra is not None and router.metrics()[f"engines/requests/{b.url}"] \
                == m[f"engines/requests/{b.url}"] + 1  # new requests: b only
        finally:
            await router.close()
            await clients[0].close()  # drained: no longer the router's to close


def test_the_command_says_what_is_wrong(tmp_path, capsys):
    from palaestra.run import engines_cli

    parser = argparse.ArgumentParser()
    engines_cli.configure(parser)

    def run(*argv: str) -> tuple[int, str]:
        code = engines_cli.run(parser.parse_args(list(argv)))
        return code, capsys.readouterr().err

    code, err = run("list", "--run", str(tmp_path / "nowhere"))
    assert code == 2 and "no run directory" in err
    code, err = run("add", "http://127.0.0.1:30000", "--run", str(tmp_path))
    assert code == 2 and "no running run" in err and "admin.json" in err
    code, err = run("add", "ftp://x", "--run", str(tmp_path))
    assert code == 2 and "not an engine URL" in err
    (tmp_path / "admin.json").write_text(json.dumps({"url": "http://127.0.0.1:9"}))
    (tmp_path / "admin.token").write_text("t")
    code, err = run("list", "--run", str(tmp_path))
    assert code == 2 and "does not answer" in err and "stale" in err


async def test_an_engine_of_another_model_is_refused(tmp_path, servers):
    """The run's policy is the tiny model; the servers serve the micro one."""
    from palaestra.errors import EngineError
    from palaestra.engines.clients.sglang import SGLangEngine
    from palaestra.engines.weights.disk_sender import DiskWeightSender
    from palaestra.tiny_model import build_model
    from palaestra.run.fleet.elastic import ElasticEngines
    from palaestra.run.fleet.engine_sync import EngineSync

    a, b = servers
    policy = build_model(tmp_path / "tiny", "tiny")
    engine = SGLangEngine([a.url], health_interval_s=0)
    await engine.start()
    try:
        sync = EngineSync("disk", engine, sender=DiskWeightSender(engine.clients, tmp_path / "w"),
                          bucket_bytes=1 << 20)
        elastic = ElasticEngines(engine, sync, policy)
        with pytest.raises(EngineError, match="another model than the run's policy") as err:
            await elastic.request_add(b.url)
        assert "hidden_size 32 != 128" in str(err.value)
        assert [c.url for c in engine.clients] == [a.url]  # nothing joined
        assert elastic.listing()["joining"] == []
    finally:
        await engine.close()


@pytest.mark.slow
def test_engines_join_and_leave_through_sglang_router(tmp_path, micro_model, servers):
    """``engine.router = "sglang"``: the run starts SGLang's router in front of its server, an
    added server joins through the router's worker API and a removed one drains out of it; the
    run ends with the router stopped and no endpoint fallback in its log."""
    pytest.importorskip("sglang_router", reason="sglang-router is not installed")
    from palaestra.engines.clients.sglang_router import FALLBACK_MARKERS
    from palaestra.run.engines_cli import call

    a, b = servers
    steps = 4
    (tmp_path / "slow_env.py").write_text(SLOW_ENV)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "palaestra", "train",
                             str(_config(tmp_path, micro_model, a.url, steps)),
                             "--engine.router", "sglang"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(run / "admin.json", proc)
        joined = call(run, "add", b.url)
        assert joined["url"] == b.url
        drained = call(run, "remove", a.url, timeout_s=30)
        assert drained["name"] == a.url and drained["retried"] == 0
        assert [e["name"] for e in call(run, "list")["engines"]] == [b.url]
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rl = [r for r in _read(run / "metrics.jsonl") if r["phase"] == "rl"]
    assert len(rl) == steps and all(r["episodes/failed"] == 0 for r in rl)
    assert rl[-1]["engines/added"] == 1 and rl[-1]["engines/removed"] == 1
    assert rl[-1]["engines/count"] == 1
    final = json.loads((run / "engines.json").read_text())
    assert final["served_versions"] == {b.url: str(steps)}
    log = (run / "servers" / "sglang-router.log").read_text()
    assert not [line for line in log.splitlines() if any(m in line for m in FALLBACK_MARKERS)]
    out = subprocess.run(["pgrep", "-f", f"sglang_router.launch_router.*{a.url}"],
                         check=False, capture_output=True, text=True).stdout
    assert not out.strip(), "the router outlived the run"

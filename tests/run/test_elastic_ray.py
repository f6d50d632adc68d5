"""Elastic engines with Ray rollout workers (``rollout.cluster = "ray"``): ``palaestra engines
add --gpus 0`` starts an engine actor in a running ``palaestra train``, the workers' routers
learn of it at the step boundary where it got the current weights, and it serves the next step
at that version; ``engines remove`` drains it out of every worker and kills its actor. Plus the
worker side alone: `RolloutWorker.set_engine_urls` over real ``palaestra serve`` processes."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from test_engine_actors import gone, read_jsonl, run_config, start_run, wait_for

pytest.importorskip("ray")


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory):
    from palaestra.tiny_model import build_model

    return build_model(tmp_path_factory.mktemp("elastic-ray") / "model", "micro")


@pytest.fixture(scope="module")
def two_servers(micro_model, tmp_path_factory):
    from palaestra.rollout.testing import serve_processes

    with serve_processes(micro_model, 2, tmp_path_factory.mktemp("serve-logs")) as procs:
        yield procs


async def test_a_worker_routes_over_the_urls_it_is_given(two_servers, micro_model):
    from palaestra.agents import AgentSpec
    from palaestra.engine import SamplingParams
    from palaestra.rollout.config import EngineSpec, WorkerConfig
    from palaestra.rollout.worker import RolloutWorker

    a, b = two_servers
    config = WorkerConfig(engine=EngineSpec.http([a.url], router={"health_interval_s": 0}),
                          agent=AgentSpec(str(micro_model)))
    worker = RolloutWorker(config)
    await worker.warmup()
    try:
        short = SamplingParams(max_new_tokens=2)
        assert await worker.set_engine_urls([a.url, b.url]) == {"finished": 0, "retried": 0}
        served = {(await worker.engine.generate([1, 2], short)).meta["engine"] for _ in range(4)}
        assert served == {a.url, b.url}
        long = SamplingParams(max_new_tokens=64, ignore_eos=True)
        busy = [asyncio.ensure_future(worker.engine.generate([1, 2, 3], long)) for _ in range(4)]
        await asyncio.sleep(0.05)
        drained = await worker.set_engine_urls([b.url], drain_timeout_s=30)
        assert drained["retried"] == 0 and all(len(g.token_ids) == 64 for g in
                                               await asyncio.gather(*busy))
        assert [s["name"] for s in (await worker.stats())["engines"]] == [b.url]
        assert worker.config.engine.urls == (b.url,)  # a rebuilt engine uses the new list
        stats = await worker.stats()
        assert stats["engine_metrics"][f"engines/requests/{a.url}"] >= 1
    finally:
        await worker.shutdown()


def rl_rows(metrics) -> list[dict]:
    return [r for r in read_jsonl(metrics) if r.get("phase") == "rl"]


@pytest.mark.slow
def test_engines_add_gpus_0_and_remove_with_ray_workers(tmp_path, micro_model):
    """The run is held still (its env resets nothing) from after step 0 until the new engine
    waits to join, so the join's step does not depend on how fast this machine starts an
    engine: it joins at the first boundary after the hold, with steps left to serve and drain."""
    import threading

    from palaestra.run.engines_cli import call

    steps = 6
    config = run_config(tmp_path, micro_model, steps=steps, engines=1, cluster="ray")
    hold = tmp_path / "hold"
    proc = start_run(tmp_path, config, sleep_s=0.2, hold_file=hold)
    run = tmp_path / "run"
    metrics = run / "metrics.jsonl"
    answers: dict = {}

    def add() -> None:  # returns once it serves, at the next step boundary
        try:
            answers["joined"] = call(run, "add", gpus=0)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            answers["error"] = exc

    adder = threading.Thread(target=add, daemon=True)
    try:
        wait_for(run / "admin.json", proc)
        first = call(run, "list")["actors"][0]
        while not metrics.exists() or not read_jsonl(metrics):  # mid-run: after step 0
            assert proc.poll() is None
            time.sleep(0.05)
        hold.touch()  # no step finishes from here until the new engine waits to join
        held_at = len(rl_rows(metrics))
        adder.start()
        deadline = time.monotonic() + 180
        while not call(run, "list")["joining"]:
            assert proc.poll() is None and "error" not in answers, answers
            assert time.monotonic() < deadline, "the new engine never came up to join"
            time.sleep(0.1)
        assert len(rl_rows(metrics)) <= held_at + 1  # held: at most the step in flight ended
        hold.unlink()
        adder.join(timeout=180)
        assert "error" not in answers, answers
        joined = answers["joined"]
        actor = joined["actor"]
        assert joined["url"] == actor["url"] != first["url"] and actor["gpus"] == 0
        # the first boundary after the hold (async prefetch may have one step in flight)
        assert 0 < joined["version"] == joined["step"] <= held_at + 2 < steps - 2
        listed = call(run, "list")
        assert {e["name"]: e["weight_version"] for e in listed["engines"]} == {
            first["url"]: joined["version"], actor["url"]: joined["version"]}
        assert sorted(a["url"] for a in listed["actors"]) == sorted([first["url"], actor["url"]])
        # let it serve a step, then drain it out of the run: its actor is killed
        while not any(r.get("step") == joined["step"] for r in read_jsonl(metrics)):
            assert proc.poll() is None
            time.sleep(0.05)
        drained = call(run, "remove", actor["url"], timeout_s=30)
        assert drained["actor_killed"] and drained["retried"] == 0
        assert gone(actor["server_pid"]) and gone(actor["actor_pid"])
        assert [a["url"] for a in call(run, "list")["actors"]] == [first["url"]]
        out, _ = proc.communicate(timeout=400)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert f"{actor['url']} joined at weight version {joined['version']}" in out
    rl = [r for r in read_jsonl(run / "metrics.jsonl") if r["phase"] == "rl"]
    assert [r["version"] for r in rl] == list(range(steps))
    # every sampled token at the batch's version: the new engine served the current weights
    assert all(r["staleness/max"] == 0 for r in rl)
    new = f"engines/requests/{actor['url']}"
    served = [r.get(new, 0.0) for r in rl]
    step = joined["step"]
    assert all(n == 0 for n in served[:step])  # nothing before it joined
    assert served[step] > 0  # the Ray workers sent it requests in the step it joined at
    assert served[-1] == served[-2] and rl[-1]["engines/removed"] == 1  # drained: no more
    assert rl[-1]["engines/added"] == 1 and rl[-1]["engines/count"] == 1
    final = json.loads((run / "engines.json").read_text())
    assert final["served_versions"] == {first["url"]: str(steps)}


def test_engines_add_takes_a_url_or_gpus(tmp_path):
    from palaestra.errors import ConfigError
    from palaestra.run.engines_cli import call

    with pytest.raises(ConfigError, match="an engine URL or --gpus N"):
        call(tmp_path, "add")
    with pytest.raises(ConfigError, match="an engine URL or --gpus N"):
        call(tmp_path, "add", "http://127.0.0.1:30000", gpus=1)
    with pytest.raises(ConfigError, match="--gpus must be >= 0"):
        call(tmp_path, "add", gpus=-1)
    with pytest.raises(ConfigError, match="no running run"):  # then: is a run there?
        call(tmp_path, "add", gpus=0)

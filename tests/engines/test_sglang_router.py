"""SGLang's own router (``sglang-router``, the real Rust binary) in front of real ``palaestra
serve`` processes on loopback, driven through `SGLangEngine(router="sglang")`: what the router
promises, checked against our servers. It registers them without falling back to older endpoint
names; episodes run through it; its cache-aware policy keeps a conversation on one worker;
workers join (``POST /workers``) and leave (``DELETE /workers/{id}``) while requests are in flight
and nothing is lost; weight updates and cache flushes reach every worker (directly, as slime
sends them); a worker killed mid-run loses no request (the router's health checks drop it and
the requests are sent again). Skipped, with the reason, where the router is not installed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from palaestra.engine import SamplingParams

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install "
                    "'sglang-router==0.3.2', in the dev extra)")

SERVE_ARGS = ("--threads", "1", "--max-running", "64")


async def _workers(model_dir: str, n: int, log_dir) -> list:
    from palaestra.engines.clients.server_process import wait_all_ready
    from palaestra.engines.serve.serve import serve_process

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [serve_process(model_dir, device="cpu", extra=SERVE_ARGS, env=env,
                           log_path=log_dir / f"serve-{i}.log") for i in range(n)]
    await wait_all_ready(procs, 120)
    return procs


@pytest.fixture(scope="module")
def workers(model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """Two ``palaestra serve --device cpu`` processes for the module's tests."""
    procs = asyncio.run(_workers(model_dir, 2, tmp_path_factory.mktemp("router-workers")))
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture
async def routed(workers, tmp_path):
    from palaestra.engines.clients.sglang import SGLangEngine

    engine = SGLangEngine([p.url for p in workers], router="sglang", log_dir=tmp_path)
    await engine.start()
    yield engine
    await engine.close()


async def _info(client) -> dict:
    info = await client.request("GET", "/server_info")
    return dict(info["internal_states"][0])


async def _served(engine) -> dict[str, float]:
    """Requests each worker has served so far (its own counter)."""
    return {c.url: (await _info(c))["requests"] for c in engine.clients}


async def test_router_registers_workers_and_runs_episodes(routed, model_dir: str) -> None:
    from palaestra.agents import make_agent
    from palaestra.envs import make
    from palaestra.rollout.play import run_episode

    router = routed._target.router
    workers = await router.workers()
    assert {w["url"] for w in workers} == {c.url for c in routed.clients}
    assert all(w["is_healthy"] and w["connection_mode"] == "HTTP" for w in workers)
    # what the router read from /server_info and /model_info, asked under their current names
    assert all(w["metadata"]["model_path"] == model_dir for w in workers)
    trajs = await asyncio.gather(*(run_episode(
        make("palaestra/Calculator-v0"), make_agent(model_dir, "qwen", max_context=512), routed,
        SamplingParams(max_new_tokens=24),
        seed=i, task={"id": f"t{i}", "question": f"What is {i} + 2?", "answer": str(i + 2)},
        session_id=f"s{i}") for i in range(6)))
    # the random tiny model rarely ends its turn: episodes stop at the token budget, whole
    assert all(t.error is None and t.samples for t in trajs), [t.error for t in trajs]
    assert all(sum(s.loss_mask_T) > 0 for t in trajs for s in t.samples)
    assert router.fallbacks() == [], "the router fell back to an older endpoint name"
    assert await routed.health()


async def test_cache_aware_policy_keeps_a_conversation_on_one_worker(routed) -> None:
    import random

    sampling = SamplingParams(max_new_tokens=6, temperature=0)

    async def conversation(seed: int) -> list[tuple[int, int]]:
        """(prompt tokens already served before, tokens the answer's worker had cached)."""
        rng = random.Random(seed)
        prompt, seen, out = [rng.randrange(10, 500) for _ in range(48)], 0, []
        for _turn in range(3):
            gen = await routed.generate(prompt, sampling)
            out.append((seen, gen.cached_tokens))
            seen = len(prompt)
            prompt = prompt + list(gen.token_ids) + [rng.randrange(10, 500) for _ in range(8)]
        return out

    before = await _served(routed)
    turns = await asyncio.gather(*(conversation(seed) for seed in range(8)))
    after = await _served(routed)
    # every later turn found the conversation so far in its worker's prefix cache: it went to
    # the worker of the turns before it (another worker would have cached none of it)
    assert all(cached >= seen for conv in turns for seen, cached in conv[1:]), turns
    assert sum(after.values()) - sum(before.values()) == 8 * 3  # each turn served once


async def test_weight_updates_and_flush_reach_every_worker(routed, other_weights_dir: str,
                                                           model_dir: str) -> None:
    sampling = SamplingParams(max_new_tokens=4, temperature=0)
    await asyncio.gather(*(routed.generate(list(range(20, 60 + i)), sampling) for i in range(8)))
    assert sum([(await _info(c))["prefix_cache_entries"] for c in routed.clients]) > 0
    await routed.update_weights(path=other_weights_dir, version=5)
    for client in routed.clients:  # each worker, asked directly
        info = await client.request("GET", "/model_info")
        assert info["weight_version"] == "5" and info["model_type"] == "qwen3"
        assert (await _info(client))["prefix_cache_entries"] == 0  # the update flushed it
    gens = await asyncio.gather(*(routed.generate(list(range(30, 50 + i)), sampling)
                                  for i in range(6)))
    assert {g.weight_version for g in gens} == {5}
    await routed.flush_cache()
    assert [(await _info(c))["prefix_cache_entries"] for c in routed.clients] == [0, 0]
    await routed.update_weights(path=model_dir, version=6)  # the module's workers, as they were


@pytest.mark.slow
async def test_workers_join_and_leave_while_requests_are_in_flight(model_dir: str,
                                                                   tmp_path) -> None:
    from palaestra.engines.clients.sglang import SGLangEngine
    from palaestra.engines.clients.sglang_client import SGLangClient

    procs = await _workers(model_dir, 3, tmp_path)
    first, second, third = procs
    engine = SGLangEngine([first.url, second.url], router="sglang", log_dir=tmp_path,
                          router_args=("--policy", "round_robin"))
    try:
        await engine.start()
        routed = engine._target
        assert routed.router.process.argv[-2:] == ["--policy", "round_robin"]
        long = SamplingParams(max_new_tokens=160, temperature=0, ignore_eos=True)
        flight = [asyncio.ensure_future(routed.generate(list(range(40 + i, 90 + i)), long))
                  for i in range(10)]
        while sum([(await _info(c))["generated_tokens"] for c in engine.clients]) < 40:
            await asyncio.sleep(0.05)
        joiner = SGLangClient(third.url)
        await routed.add_engine(joiner)  # POST /workers, with requests in flight
        assert third.url in {w["url"] for w in await routed.router.workers()}
        drained = await routed.drain_engine(first.url, timeout_s=60)  # DELETE /workers/{id}
        assert first.url not in {w["url"] for w in await routed.router.workers()}
        gens = await asyncio.wait_for(asyncio.gather(*flight), 120)
        # nothing lost: every request ran to its length, those on the leaving worker there
        assert [len(g.token_ids) for g in gens] == [160] * 10
        assert {g.finish_reason for g in gens} == {"length"}
        assert drained["retried"] == 0 and drained["finished"] == drained["in_flight"]
        before = await _info(SGLangClient(first.url))
        await asyncio.gather(*(routed.generate(list(range(300 + 3 * i, 340 + 3 * i)),
                                               SamplingParams(max_new_tokens=4))
                               for i in range(8)))
        assert (await _info(SGLangClient(first.url)))["requests"] == before["requests"]
        assert (await _info(joiner))["requests"] > 0
        assert routed.metrics()["engines/added"] == 1.0
        assert routed.router.fallbacks() == []
    finally:
        await engine.close()
        for p in procs:
            p.stop()


@pytest.mark.slow
async def test_a_worker_killed_mid_run_loses_no_request(model_dir: str, tmp_path) -> None:
    from palaestra.engines.clients.sglang import SGLangEngine

    procs = await _workers(model_dir, 2, tmp_path)
    engine = SGLangEngine([p.url for p in procs], router="sglang", log_dir=tmp_path)
    try:
        await engine.start()
        routed = engine._target
        long = SamplingParams(max_new_tokens=120, temperature=0, ignore_eos=True)
        flight = [asyncio.ensure_future(routed.generate(list(range(60 + 7 * i, 110 + 7 * i)),
                                                        long)) for i in range(12)]
        victim, survivor = procs
        while (await _info(engine.clients[0]))["generated_tokens"] < 30:
            await asyncio.sleep(0.05)
        os.killpg(victim.proc.pid, signal.SIGKILL)  # a crash: connections reset, no drain
        start = time.monotonic()
        gens = await asyncio.wait_for(asyncio.gather(*flight), 120)  # never hangs
        assert [len(g.token_ids) for g in gens] == [120] * 12  # none lost, none cut short
        # the victim's requests were sent again (by the router's own retries, or by ours
        # through it) and all of them ran whole on the survivor
        assert (await _info(engine.clients[1]))["finished"] >= 12
        # its health checks (every second, two misses) take the dead worker out of routing
        deadline = time.monotonic() + 20
        while victim.url in {w["url"] for w in await routed.router.workers()
                             if w["is_healthy"]}:
            assert time.monotonic() < deadline, "the router still routes to the dead worker"
            await asyncio.sleep(0.2)
        assert survivor.url in {w["url"] for w in await routed.router.workers()
                                if w["is_healthy"]}
        print(f"12 requests done {time.monotonic() - start:.1f} s after the kill, "
              f"{routed.retried} sent again")
        gen = await routed.generate([5, 6, 7], SamplingParams(max_new_tokens=3))
        assert len(gen.token_ids) == 3
    finally:
        await engine.close()
        for p in procs:
            p.stop()


async def test_router_refused_without_the_wheel_or_on_the_embedded_engine(monkeypatch) -> None:
    from palaestra.engines.clients import sglang_router
    from palaestra.engines.clients.sglang import SGLangEngine
    from palaestra.errors import ConfigError
    from palaestra.run.config import TrainConfig
    from palaestra.run.config_checks import launch_problems
    from palaestra.run.fleet.router import router_problems

    cfg = TrainConfig.model_validate({"engine": {"kind": "sglang", "router": "sglang",
                                                 "urls": ["http://127.0.0.1:9"]},
                                      "rollout": {"cluster": "local"}})
    assert router_problems(cfg) == []
    assert not [p for p in launch_problems(cfg) if "engine.router" in p.fields]
    with pytest.raises(ValueError, match="engine.router = 'sglang' routes over servers"):
        TrainConfig.model_validate({"engine": {"router": "sglang"},
                                    "rollout": {"cluster": "local"}})
    with pytest.raises(ValueError, match="rollout.cluster = 'ray' is not supported yet"):
        TrainConfig.model_validate({"engine": {"kind": "sglang", "router": "sglang",
                                               "urls": ["http://127.0.0.1:9"]}})
    with pytest.raises(ValueError, match="engine.router_args are flags of SGLang's router"):
        TrainConfig.model_validate({"engine": {"kind": "sglang", "urls": ["http://127.0.0.1:9"],
                                               "router_args": ["--policy", "round_robin"]},
                                    "rollout": {"cluster": "local"}})
    monkeypatch.setattr(sglang_router, "router_installed", lambda: False)
    problems = launch_problems(cfg)
    assert any("pip install 'sglang-router==0.3.2'" in p.message for p in problems)
    with pytest.raises(ConfigError, match="pip install"):
        await SGLangEngine(["http://127.0.0.1:9"], router="sglang").start()

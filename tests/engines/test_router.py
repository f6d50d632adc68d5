"""Router over real servers: least outstanding requests, sticky sessions, failover when a server
dies mid-run, health checks, engines added and removed at runtime."""

from __future__ import annotations

import asyncio

import pytest

from palaestra.engine import EngineUnavailableError, SamplingParams
from palaestra.engines.local.local import LocalEngine
from palaestra.engines.clients.router import Router
from palaestra.engines.serve.serve import start_server
from palaestra.engines.clients.sglang_client import SGLangClient

from engine_testing import prompts


@pytest.fixture
async def two_servers(model_dir: str):
    engines = [LocalEngine(model_dir), LocalEngine(model_dir)]
    servers = [await start_server(e) for e in engines]
    clients = [SGLangClient(s.url, retries=1, backoff_s=0.02, connect_timeout_s=1)
               for s in servers]
    yield engines, servers, clients
    for c in clients:
        await c.close()
    for s in servers:
        await s.close()
    for e in engines:
        await e.close()


async def test_requests_survive_a_server_dying_mid_run(two_servers) -> None:
    engines, servers, clients = two_servers
    router = Router(clients, health_interval_s=0.05)
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    batch = prompts(12, seed=30)
    tasks = [asyncio.create_task(router.generate(p, params, session_id=f"s{i}"))
             for i, p in enumerate(batch)]
    while min(e.stats["generated_tokens"] for e in engines) < 5:  # both are busy
        await asyncio.sleep(0.005)
    await servers[0].kill()  # the first server dies with requests in flight
    results = await asyncio.gather(*tasks)
    assert all(len(g.token_ids) == 40 and g.finish_reason == "length" for g in results)
    assert {g.meta["engine"] for g in results} == {servers[1].url}
    status = {s["name"]: s for s in router.status()}
    assert status[servers[0].url]["healthy"] is False
    assert status[servers[0].url]["failures"] >= 1
    # greedy results equal what the survivor computes alone
    for p, g in zip(batch[:3], results[:3]):
        assert (await engines[1].generate(p, params)).token_ids == g.token_ids
    await router.close()


async def test_least_outstanding_and_sticky_sessions(two_servers) -> None:
    engines, servers, clients = two_servers
    router = Router(clients, health_interval_s=0)
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    gens = await asyncio.gather(*(router.generate(p, params) for p in prompts(8, seed=31)))
    served = [s["served"] for s in router.status()]
    assert served == [4, 4]  # spread evenly
    # every turn of a session goes to the same engine, and turn 2 reuses turn 1's KV there
    p = prompts(1, lo=40, hi=41, seed=32)[0]
    first = await router.generate(p, params, session_id="episode-7")
    turn2 = p + list(first.token_ids) + [11, 12, 13]
    second = await router.generate(turn2, params, session_id="episode-7")
    assert second.meta["engine"] == first.meta["engine"]
    assert second.cached_tokens == len(p) + len(first.token_ids) - 1
    assert len(gens) == 8
    await router.close()


async def test_health_checks_and_membership(two_servers, model_dir: str) -> None:
    engines, servers, clients = two_servers
    router = Router([clients[0]], health_interval_s=0.02)
    params = SamplingParams(max_new_tokens=3, temperature=0)
    await router.generate([5, 6, 7], params)
    router.add_engine(clients[1])
    await asyncio.gather(*(router.generate(p, params) for p in prompts(4, seed=33)))
    assert all(s["served"] > 0 for s in router.status())
    await servers[1].kill()
    for _ in range(200):  # the background health check notices
        if not router.status()[1]["healthy"]:
            break
        await asyncio.sleep(0.02)
    assert router.status()[1]["healthy"] is False
    assert await router.health()  # one engine is enough
    removed = router.remove_engine(servers[0].url)
    assert removed is clients[0]
    with pytest.raises(EngineUnavailableError, match="no healthy engine"):
        await router.generate([5, 6, 7], params)
    assert not await router.health()
    await router.close()


async def test_control_calls_reach_every_engine(two_servers, other_weights_dir: str) -> None:
    from safetensors.torch import load_file

    engines, _, clients = two_servers
    router = Router(clients, health_interval_s=0)
    await router.update_weights(load_file(f"{other_weights_dir}/model.safetensors"))
    assert [e.weight_version for e in engines] == [1, 1] and router.weight_version == 1
    await router.pause()
    await router.resume()
    await router.flush_cache()
    await router.abort()
    gen = await router.generate([5, 6, 7], SamplingParams(max_new_tokens=2))
    assert gen.weight_version == 1
    await router.close()


async def test_router_over_in_process_engines(model_dir: str) -> None:
    """The router needs no HTTP: any Engine works (here two LocalEngines)."""
    a, b = LocalEngine(model_dir), LocalEngine(model_dir)
    router = Router([a, b], health_interval_s=0)
    gens = await asyncio.gather(*(router.generate(p, SamplingParams(max_new_tokens=3))
                                  for p in prompts(6, seed=34)))
    assert len(gens) == 6 and a.stats["requests"] == b.stats["requests"] == 3
    await router.close()
    assert not await a.health()  # the router closed its engines

"""LoRA over SGLang's protocol: `palaestra serve`'s /load_lora_adapter, /unload_lora_adapter and
``lora_path`` in /generate, driven by the SGLang client on loopback (two adapters at once)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

pytest.importorskip("peft")

from test_engine_lora import GREEDY, PROMPTS, assert_same, make_adapter

from palaestra.errors import EngineError
from palaestra.engines.local.local import LocalEngine
from palaestra.engines.serve.serve import start_server
from palaestra.engines.clients.sglang_client import SGLangClient


@pytest.fixture(scope="module")
def two_adapters(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    root = tmp_path_factory.mktemp("lora_serve")
    out = {}
    for seed, name in ((3, "math"), (4, "chat")):
        (root / name).mkdir()
        out[name] = make_adapter(model_dir, root / name, seed, ["q_proj", "o_proj", "up_proj"])
    return out


async def post(url: str, body: object) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, json.loads(await r.text())


async def test_two_adapters_over_sglang_protocol(model_dir: str, two_adapters) -> None:
    engine = LocalEngine(model_dir, lora_mode="lowrank")
    server = await start_server(engine)
    client = SGLangClient(server.url, retries=0)
    refs = {n: LocalEngine(str(merged), prefix_cache_tokens=0)
            for n, (_, merged) in two_adapters.items()}
    try:
        for name, (adapter, _) in two_adapters.items():
            loaded = await client.load_lora_adapter(name, str(adapter))
        assert loaded == {n: str(a) for n, (a, _) in two_adapters.items()}
        jobs = [client.generate(p, GREEDY, lora=name) for p in PROMPTS
                for name in ("math", "chat", None)]
        got = await asyncio.gather(*jobs)
        base = await asyncio.gather(*(engine.generate(p, GREEDY) for p in PROMPTS))
        for i, p in enumerate(PROMPTS):
            for j, name in enumerate(("math", "chat")):
                assert_same(got[3 * i + j], await refs[name].generate(p, GREEDY))
            assert got[3 * i + 2].token_ids == base[i].token_ids  # no lora_path: the base
        # a batched /generate names one adapter per prompt (SGLang's list form)
        status, out = await post(server.url + "/generate", {
            "input_ids": PROMPTS[:2], "lora_path": ["chat", "math"], "return_logprob": True,
            "sampling_params": GREEDY.to_sglang()})
        assert status == 200
        assert out[0]["output_ids"] == list(got[1].token_ids)
        assert out[1]["output_ids"] == list(got[3].token_ids)
        # errors in SGLang's shape, and through the client as EngineError
        status, out = await post(server.url + "/load_lora_adapter",
                                 {"lora_name": "x", "lora_path": "/nonexistent"})
        assert status == 400 and not out["success"] and "peft adapter folder" in out["error_message"]
        assert set(out["loaded_adapters"]) == {"math", "chat"}
        with pytest.raises(EngineError, match="no LoRA adapter named 'nope'"):
            await client.generate(PROMPTS[0], GREEDY, lora="nope")
        assert await client.unload_lora_adapter("math") == {"chat": str(two_adapters["chat"][0])}
        for gone in (client.unload_lora_adapter("math"),
                     client.generate(PROMPTS[0], GREEDY, lora="math")):
            with pytest.raises(EngineError, match="no LoRA adapter named 'math'"):
                await gone
    finally:
        await client.close()
        await server.close()
        for e in (engine, *refs.values()):
            await e.close()


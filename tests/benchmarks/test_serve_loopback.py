"""Both remote paths against a real `palaestra serve` (LocalEngine on a micro model) over loopback:
``--engine openai`` (message level, ``/v1/chat/completions`` with tools) and ``--engine sglang``
(token level, SGLang's native ``/generate``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from palaestra.benchmarks.backends import BackendOptions, build_policy
from palaestra.benchmarks.runner import EvalSettings, evaluate


@pytest.fixture
async def served(model_dir):
    from palaestra.engines.local.local import LocalEngine
    from palaestra.engines.serve.serve import start_server

    engine = LocalEngine(model_dir, device="cpu")
    server = await start_server(engine)
    yield server.url
    await server.close()
    await engine.close()


async def test_openai_engine_against_palaestra_serve(served, model_dir, tmp_path):
    opts = BackendOptions(engine="openai", model=Path(model_dir).name, base_url=f"{served}/v1",
                          api_key_env="PALAESTRA_TEST_NO_SUCH_KEY")  # loopback: no key needed
    policy = await asyncio.to_thread(build_policy, opts)
    settings = EvalSettings(n=2, limit=2, max_new_tokens=12, temperature=1.0, concurrency=4)
    try:
        summary = await evaluate(["calculator"], policy, settings, out_dir=tmp_path / "run",
                                 progress=False, report=False)
    finally:
        await policy.close()
    s = summary["calculator"]
    assert s["tasks"] == 2 and s["samples"] == 4 and s["errors"] == 0
    for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines():
        r = json.loads(line)
        roles = [m["role"] for m in r["trajectory"]["messages"]]
        assert roles[:3] == ["system", "user", "assistant"]
        assert 0 < r["completion_tokens"] <= 12 * r["turns"] + 12
        assert r["prompt_tokens"] > 0  # usage reported by the server
        assert r["stop_reason"] in ("max_tokens", "terminated", "truncated", "parse_error")


async def test_sglang_engine_against_palaestra_serve(served, tmp_path):
    policy = await asyncio.to_thread(build_policy, BackendOptions(engine="sglang", model=served))
    settings = EvalSettings(n=2, limit=2, max_new_tokens=12, temperature=1.0, concurrency=4)
    try:
        summary = await evaluate(["gsm8k"], policy, settings, out_dir=tmp_path / "run",
                                 progress=False, report=False)
    finally:
        await policy.close()
    assert summary["gsm8k"]["samples"] == 4 and summary["gsm8k"]["errors"] == 0
    for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines():
        r = json.loads(line)
        sample = r["trajectory"]["samples"][0]
        assert 0 < sum(sample["loss_mask"]) == r["completion_tokens"] <= 12
        assert len(sample["token_ids"]) == r["total_tokens"]
        assert r["stop_reason"] in ("max_tokens", "terminated")

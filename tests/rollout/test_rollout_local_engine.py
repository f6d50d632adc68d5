"""Rollouts against the real embedded engine: two `palaestra serve` processes with the micro
model, reached over HTTP by two Ray workers through the router. The samples' logprobs match a
full forward pass of the model; killing one server mid-rollout loses no episode."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from rollout_helpers import calc_rows

pytestmark = pytest.mark.timeout(600)

from palaestra.agents import AgentSpec
from palaestra.rollout.config import EngineSpec, RolloutConfig, WorkerConfig
from palaestra.rollout.data import DataSource
from palaestra.rollout.manager import RolloutManager
from palaestra.engine import SamplingParams
from palaestra.engines.serve.serve import serve_argv


def _serve(model_dir: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        serve_argv(model_dir, port=0, extra=("--threads", "1", "--max-running", "64")),
        stdout=log.open("w"), stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _url(proc: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"on (http://\S+)", log.read_text())
        if found:
            return found.group(1)
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"palaestra serve did not start:\n{log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    logs = [tmp_path_factory.mktemp("serve-logs") / f"{i}.log" for i in range(2)]
    procs = [_serve(model_dir, log) for log in logs]  # both start at once
    try:
        yield [(p, _url(p, log)) for p, log in zip(procs, logs)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()


def http_config(model_dir: str, urls: list[str], max_new_tokens: int = 24) -> WorkerConfig:
    return WorkerConfig(
        engine=EngineSpec.http(urls, router={"health_interval_s": 0.5}),
        agent=AgentSpec(model_dir, max_context=1024),
        sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0),
        max_turns=2,
    )


async def test_batch_64x4_with_local_engine_matches_forward_pass(ray_pool, servers, model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    urls = [u for _, u in servers]
    cfg = RolloutConfig(batch_size=64, group_size=4, num_workers=2, max_concurrency=256)
    async with RolloutManager(DataSource(calc_rows(100), seed=0), http_config(model_dir, urls),
                              cfg, pool=ray_pool) as m:
        batch = await m.generate_batch(0)
    assert len(batch.samples) == 256 and batch.metrics["episodes/failed"] == 0
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    worst = 0.0
    for s in batch.samples:
        assert s.num_sampled > 0 and not any(s.loss_mask_T[: s.prompt_len])
        ids = torch.tensor([s.token_ids_T])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
        for i, m in enumerate(s.loss_mask_T):
            if m:  # the engine's logprob of the sampled token = the model's, in its context
                worst = max(worst, abs(float(logp[i - 1, s.token_ids_T[i]]) - s.logprobs_T[i]))
    assert worst < 1e-3, worst


async def test_killing_one_engine_mid_rollout_loses_no_episode(ray_pool, servers, model_dir):
    urls = [u for _, u in servers]
    cfg = RolloutConfig(batch_size=48, group_size=4, num_workers=2, max_concurrency=64)
    async with RolloutManager(DataSource(calc_rows(100), seed=1),
                              http_config(model_dir, urls, max_new_tokens=48), cfg,
                              pool=ray_pool) as m:
        run = asyncio.ensure_future(m.generate_batch(0))
        deadline = time.monotonic() + 120
        while len(m._step.finished) < 16:  # let episodes reach both engines first
            await asyncio.sleep(0.05)
            assert not run.done() and time.monotonic() < deadline
        servers[1][0].kill()
        batch = await run
        stats = await m.worker_stats()
    assert len(batch.group_ids) == 48 and len(batch.samples) == 192
    assert batch.metrics["episodes/failed"] == 0, [t.error for t in batch.failed][:3]
    assert batch.metrics["episodes/finished"] == 192
    dead = [e for w in stats for e in w["engines"] if e["name"] == servers[1][1]]
    assert any(e["failures"] > 0 and not e["healthy"] for e in dead)  # requests moved over
    used = {e["name"] for w in stats for e in w["engines"] if e["served"] > 0}
    assert used == set(urls)  # both engines served episodes before the kill

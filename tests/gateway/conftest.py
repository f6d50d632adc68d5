"""Fixtures of the gateway tests: the micro model (built once), a real `LocalEngine` per test, a
gateway served on loopback, and engines that record, steer, delay or abort generations."""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """The micro Qwen3 model and its tokenizer (built locally, once per session)."""
    import torch

    from palaestra.tiny_model import build_model

    torch.set_num_threads(1)
    return str(build_model(tmp_path_factory.mktemp("gateway-model"), "micro"))


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from palaestra.agents import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture
async def engine(model_dir, tokenizer):
    from palaestra.engines.local.local import LocalEngine

    eng = LocalEngine(model_dir, tokenizer=tokenizer, device="cpu", seed=0)
    yield eng
    await eng.close()


class Recording:
    """An engine wrapper that keeps every request and generation (to compare with samples)."""

    def __init__(self, engine, *, delay_s: float = 0.0, abort_first_after: int | None = None):
        self.engine = engine
        self.calls: list[tuple[list[int], object]] = []
        self.delay_s = delay_s
        self.abort_first_after = abort_first_after

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    async def generate(self, input_ids, sampling, **kw):
        import asyncio
        from dataclasses import replace

        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.abort_first_after is not None:  # a weight update lands mid-generation
            n, self.abort_first_after = self.abort_first_after, None
            gen = await self.engine.generate(input_ids, replace(sampling, max_new_tokens=n), **kw)
            gen = replace(gen, finish_reason="abort")
        else:
            gen = await self.engine.generate(input_ids, sampling, **kw)
        self.calls.append((list(input_ids), gen))
        return gen

    async def health(self) -> bool:
        return await self.engine.health()

    async def close(self) -> None:
        await self.engine.close()


class Steer:
    """Logits processor: bias each request towards a scripted reply (canonical tokens)."""

    def __init__(self, tokenizer, replies: Sequence[str]):
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.targets = [list(tokenizer.encode(r, add_special_tokens=False)) + [end]
                        for r in replies]
        self.by_request: dict[str, int] = {}

    def __call__(self, logits, reqs) -> None:
        for row, req in enumerate(reqs):
            k = self.by_request.setdefault(req.request_id, len(self.by_request))
            target = self.targets[min(k, len(self.targets) - 1)]
            pos = len(req.output_ids)
            if pos < len(target):
                logits[row, target[pos]] += 60.0


@pytest.fixture
def recording():
    return Recording


@pytest.fixture
def steer():
    return Steer


@pytest.fixture
async def served(engine, tokenizer):
    """A gateway over a recording engine, served on 127.0.0.1: (gateway, server, recorder)."""
    from palaestra.engine import SamplingParams
    from palaestra.rollout.gateway.gateway import Gateway
    from palaestra.rollout.gateway.server import serve_gateway

    rec = Recording(engine)
    gateway = Gateway(rec, tokenizer, "qwen", max_context=1024,
                      sampling=SamplingParams(max_new_tokens=10, seed=7))
    server = await serve_gateway(gateway)
    yield gateway, server, rec
    await server.close()

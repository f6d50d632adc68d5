"""A LoRA backend's adapter-only sync through `EngineSync`: in process to the embedded engine,
and to an SGLang-protocol server (`palaestra serve` on loopback) over /load_lora_adapter; both
generate what the merged model generates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from palaestra.engine import SamplingParams
from palaestra.engines.local.local import LocalEngine
from palaestra.trainers.algorithms.config import LossConfig
from palaestra.run.fleet.engine_sync import EngineSync
from palaestra.run.fleet.weight_pushes import build_push
from palaestra.trainers.torch_backend.backend import TorchBackend
from palaestra.trainers.torch_backend.config import TorchBackendConfig
from palaestra.trainers.torch_backend.lora import LoraSettings

torch.set_num_threads(1)
GREEDY = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 42, 9], [100, 3, 77, 12, 40]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from palaestra.tiny_model import build_model

    return str(build_model(tmp_path_factory.mktemp("lora_sync") / "m", "micro"))


def trained(model_dir: str, steps: int) -> TorchBackend:
    from palaestra.trainers.batching import TrainBatch

    b = TorchBackend(model_dir, TorchBackendConfig(device="cpu", lr=5e-2,
                                                   lora=LoraSettings(rank=4, alpha=8.0)))
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 200, (12,), generator=g) for _ in range(4)]
    mask = [torch.tensor([0.0] * 4 + [1.0] * 8) for _ in ids]
    batch = TrainBatch(token_ids=ids, loss_mask=mask, advantages=[m * (1 - 2 * (i % 2))
                                                                   for i, m in enumerate(mask)],
                       rollout_logprobs=[m * -5 for m in mask], group_ids=["a"] * 4)
    for _ in range(steps):
        b.train_step(batch, LossConfig(preset="grpo"))
    return b


async def outputs(engine, **kw) -> list:
    return [await engine.generate(p, GREEDY, **kw) for p in PROMPTS]


async def test_in_process_and_server_syncs_send_the_adapter_only(model_dir: str,
                                                                 tmp_path: Path) -> None:
    from palaestra.engines.serve.serve import start_server
    from palaestra.engines.clients.sglang import SGLangEngine

    backend = trained(model_dir, 2)
    backend.export_hf(tmp_path / "merged")
    reference = LocalEngine(str(tmp_path / "merged"), prefix_cache_tokens=0)
    local = LocalEngine(model_dir, prefix_cache_tokens=0)
    served = LocalEngine(model_dir, prefix_cache_tokens=0, lora_mode="lowrank")
    server = await start_server(served)
    remote = SGLangEngine([server.url])
    await remote.start()
    try:
        want = await outputs(reference)
        base = await outputs(local)  # before the sync: the base model, which the adapter moved
        assert any(max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) > 1e-3
                   for g, w in zip(base, want))
        full = sum(t.numel() * 4 for t in backend.state_dict_for_engines().values())
        sync = EngineSync("in_process", local, bucket_bytes=1 << 20)
        stats = await build_push(sync, backend).push(1)
        assert 0 < stats.num_bytes < full / 5  # the adapter, not the model
        for got, w in zip(await outputs(local), want):
            assert got.token_ids == w.token_ids
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(w.logprobs),
                                       atol=1e-4, rtol=0)
        to_server = build_push(EngineSync("tensor", remote, bucket_bytes=1 << 20,
                                          lora_servers=True, adapter_dir=tmp_path / "lora-sync"),
                               backend)
        await to_server.push(1)
        assert served.lora_adapters == ["policy-v1"] and remote.default_lora == "policy-v1"
        for got, w in zip(await outputs(remote), want):  # requests name the adapter
            assert got.token_ids == w.token_ids
        backend.train_step(*_one_more(backend))
        await to_server.push(2)
        assert served.lora_adapters == ["policy-v2"]  # the previous version unloaded
        assert not (tmp_path / "lora-sync" / "policy-v1").exists()
    finally:
        await remote.close()
        await server.close()
        for e in (reference, local, served):
            await e.close()


def _one_more(backend: TorchBackend):
    from palaestra.trainers.batching import TrainBatch

    ids = [torch.arange(3, 15)]
    mask = [torch.tensor([0.0] * 4 + [1.0] * 8)]
    return (TrainBatch(token_ids=ids, loss_mask=mask, advantages=mask,
                       rollout_logprobs=[m * -5 for m in mask], group_ids=["a"]),
            LossConfig(preset="grpo"))

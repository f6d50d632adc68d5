"""A trainer group's rank 0 pushes its weights to the servers itself; the driver only coordinates.

Two torch-backend ranks (FSDP2 over gloo) as Ray actors train a step and `EngineSync` (a real
``palaestra serve`` process on loopback, ``engine.kind = "sglang"``) pushes by each server path:
the gloo weight-update group (rank 0 joins it as the servers' rank 0), a version folder on disk,
HTTP tensors, and a one-off group for an engine joining the run. After every push the server's
weights equal those of one process trained on the same batches (read back with
``/get_weights_by_name`` and by a greedy generation's logprobs against an in-process engine
holding those weights), its version is the pushed one, rank 0's process did the sending, and
the driver never held a state dict (`TrainerGroup.weight_relays` stays 0).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from palaestra.config import validate
from palaestra.engine import SamplingParams
from palaestra.run.fleet.placement import PlacementSection, plan_run
from palaestra.trainers.algorithms.config import LossConfig
from palaestra.trainers.batching import TrainBatch
from palaestra.run.config import TrainConfig

torch.set_num_threads(1)
ray = pytest.importorskip("ray")
PROMPT = [3, 17, 29, 41, 5, 8]


def batch(seed: int, vocab: int, n: int = 8) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids, masks, adv = [], [], []
    for i in range(n):
        length = 8 + (i * 5 + seed) % 12
        ids.append(torch.randint(0, vocab, (length,), generator=g))
        mask = torch.tensor([0.0] * 3 + [1.0] * (length - 3))
        masks.append(mask)
        adv.append(mask * float(torch.randn(1, generator=g)))
    return TrainBatch(token_ids=ids, loss_mask=masks, advantages=adv,
                      group_ids=[f"p{i // 4}" for i in range(n)])


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from palaestra.tiny_model import build_model

    return build_model(tmp_path_factory.mktemp("push-model") / "m", "micro", seed=3)


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory):
    from palaestra.rollout.testing import serve_processes

    with serve_processes(model, 1, tmp_path_factory.mktemp("serve"),
                         extra=("--threads", "1", "--max-running", "4")) as (proc,):
        yield proc.url


@pytest.fixture(scope="module")
def ray_local():
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=4, include_dashboard=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


def _sync(url: str, tmp_path: Path, model: Path, kind: str):
    from palaestra.engines.clients.sglang import SGLangEngine
    from palaestra.run.fleet.engine_sync import EngineSync

    settings: dict = {"kind": kind}
    if kind == "distributed":
        settings.update(backend="gloo", bucket_mb=1, timeout_s=60.0)
    elif kind == "disk":
        settings.update(dir=str(tmp_path / "versions"), bucket_mb=1)
    cfg = validate(TrainConfig, {"engine": {"kind": "sglang", "urls": [url],
                                            "weight_sync": settings}})
    engine = SGLangEngine([url])
    return engine, lambda: EngineSync.from_config(cfg.engine, engine, model, out=str(tmp_path))


async def _check_server(url: str, want: dict[str, torch.Tensor], version: int) -> Any:
    """The server holds ``want`` at ``version``; its greedy generation of PROMPT."""
    from palaestra.engines.clients.sglang_client import SGLangClient

    client = SGLangClient(url, retries=0)
    try:
        info = await client.get_model_info()
        assert info["weight_version"] == str(version)
        for name, tensor in want.items():
            got = torch.tensor(await client.get_weights_by_name(name, truncate_size=1 << 20))
            torch.testing.assert_close(got, tensor.float().reshape(got.shape), atol=1e-5, rtol=0)
        sampling = SamplingParams(max_new_tokens=6, temperature=0.0)
        served = await client.generate(PROMPT, sampling)
    finally:
        await client.close()
    return served


async def _greedy_of(model: Path, weights: dict[str, torch.Tensor]):
    from palaestra.engines.local.local import LocalEngine

    engine = LocalEngine(str(model), device="cpu", max_running=2)
    try:
        await engine.update_weights(weights, version=1)
        return await engine.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=0.0))
    finally:
        await engine.close()


@pytest.mark.slow
async def test_rank_zero_pushes_to_servers_without_the_driver(model, server, ray_local,
                                                             tmp_path):
    from palaestra.trainers.group.group import TrainerGroup
    from palaestra.trainers.group.push import EnginePushSpec
    from palaestra.run.fleet.weight_pushes import GroupPush, build_push, push_to_joining
    from palaestra.trainers.torch_backend.backend import TorchBackend
    from palaestra.trainers.torch_backend.config import TorchBackendConfig

    cfg = TorchBackendConfig(device="cpu", dtype="float32", lr=1e-2, pack_sequences=False)
    loss = LossConfig.from_preset("grpo")
    plan = plan_run(PlacementSection(gpus_per_node=0, trainer_ranks=2), on_gpu=False)
    one = TorchBackend(model, cfg)
    vocab = one.model.config.vocab_size
    with TrainerGroup(model, cfg, plan) as group:
        rank0_pid = group.ranks[0]["pid"]
        assert rank0_pid != os.getpid()
        before = one.state_dict_for_engines()
        for version, kind in enumerate(("distributed", "disk", "tensor", "ipc"), start=1):
            b = batch(version, vocab)
            got, want = group.train_step(b, loss), one.train_step(b, loss)
            assert abs(got["loss"] - want["loss"]) < 1e-5
            engine, make_sync = _sync(server, tmp_path / kind, model, kind)
            await engine.start()
            sync = make_sync()
            try:
                push = build_push(sync, group)
                stats = await push.push(version)
                assert isinstance(push, GroupPush) and push.pushes == 1
                assert group.weight_relays == 0
                assert group.last_push is not None and group.last_push["pid"] == rank0_pid
                assert stats.num_bytes > 0 and push.metrics()["sync/gbytes"] > 0
                assert engine.weight_version == version  # read back from the server
                if kind == "disk":
                    assert (tmp_path / kind / "versions" / f"v{version}").is_dir()
            finally:
                await sync.close()
                await engine.close()
            weights = one.state_dict_for_engines()
            assert any(not torch.equal(weights[k], before[k]) for k in weights)  # it trained
            served = await _check_server(server, weights, version)
            local = await _greedy_of(model, weights)
            assert list(served.token_ids) == list(local.token_ids)
            assert max(abs(a - b) for a, b in zip(served.logprobs, local.logprobs)) < 1e-4

        # an engine joining the run: a group of its own, from rank 0, closed after
        engine, make_sync = _sync(server, tmp_path / "join", model, "distributed")
        await engine.start()
        sync = make_sync()
        try:
            await push_to_joining(build_push(sync, group), engine.clients[0], 7)
            assert engine.clients[0].weight_version == 7 and group.weight_relays == 0
        finally:
            await sync.close()
            await engine.close()
        await _check_server(server, one.state_dict_for_engines(), 7)
        assert EnginePushSpec(method="ipc", urls=(server,), bucket_bytes=1).device() == "cpu"
        # the embedded engine lives in the driver: that path still brings the weights here
        group.state_dict_for_engines()
        assert group.weight_relays == 1


def test_push_spec_paths_and_refusals(tmp_path):
    from palaestra.errors import ConfigError
    from palaestra.trainers.group.push import EnginePushSpec

    spec = EnginePushSpec(method="distributed", urls=("http://a:1", "http://b:2"),
                          bucket_bytes=1 << 20, dtype="bfloat16", backend="nccl",
                          master_port=1234)
    assert spec.device() == "cuda" and spec.torch_dtype() == torch.bfloat16
    one = spec.only("http://c:3")
    assert one.urls == ("http://c:3",) and one.master_port == 0 and one.backend == "nccl"
    assert EnginePushSpec(method="disk", urls=("http://a:1",), bucket_bytes=1,
                          directory=str(tmp_path)).device() == "cpu"
    with pytest.raises(ConfigError, match="not 'in_process'"):
        EnginePushSpec(method="in_process", urls=("http://a:1",), bucket_bytes=1)
    with pytest.raises(ConfigError, match="directory"):
        EnginePushSpec(method="disk", urls=("http://a:1",), bucket_bytes=1)
    with pytest.raises(ConfigError, match="at least one server"):
        EnginePushSpec(method="tensor", urls=(), bucket_bytes=1)

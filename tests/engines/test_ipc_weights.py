"""Weights by handle through ``/update_weights_from_tensor`` (SGLang's IPC format), on the CPU.

A real ``palaestra serve`` subprocess on loopback receives buckets of shared-memory tensors from
`IpcWeightSender` (torch's multiprocessing reductions, file_system strategy: the same mechanism
as CUDA IPC, with shm file names instead of CUDA handles): its weights then equal the pushed
ones exactly, its version is the pushed one, and its greedy tokens match an in-process engine
holding those weights. The request body is checked against SGLang's
``UpdateWeightsFromTensorReqInput`` fields, the payload against a plain ``pickle.loads`` in a
fresh process (what SGLang's ForkingPickler-based deserialiser does), and bad payloads against
the server's allowlist. CUDA IPC itself runs in test_ipc_weights_gpu.py.
"""

from __future__ import annotations

import base64
import io
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from palaestra.errors import ConfigError, EngineError
from palaestra.engine import SamplingParams

torch.set_num_threads(1)
PROMPT = [3, 17, 29, 41, 5, 8]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from palaestra.tiny_model import build_model

    return build_model(tmp_path_factory.mktemp("ipc-model") / "m", "micro", seed=5)


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory):
    from palaestra.rollout.testing import serve_processes

    with serve_processes(model, 1, tmp_path_factory.mktemp("serve"),
                         extra=("--threads", "1", "--max-running", "4"),
                         env={**os.environ, "OMP_NUM_THREADS": "1"}) as (proc,):
        yield proc.url


def _new_weights(model: Path, seed: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for f in sorted(model.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            out[name] = t + 0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype)
    return out


async def _greedy_of(model: Path, weights: dict[str, torch.Tensor]) -> Any:
    from palaestra.engines.local.local import LocalEngine

    engine = LocalEngine(str(model), device="cpu", max_running=2)
    try:
        await engine.update_weights(weights, version=1)
        return await engine.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=0.0))
    finally:
        await engine.close()


async def test_ipc_buckets_reach_a_real_server_exactly(model: Path, server: str) -> None:
    from palaestra.engines.clients.sglang_client import SGLangClient
    from palaestra.engines.weights.weight_transfer import IpcWeightSender, bucketize

    weights = _new_weights(model, seed=11)
    client = SGLangClient(server, retries=0)
    sender = IpcWeightSender([client])
    try:
        stats = await sender.push(bucketize(weights.items(), 64 << 10), version=7)
        assert stats.num_buckets > 1  # bucketed: one request per bucket
        assert stats.num_tensors == len(weights)
        info = await client.get_model_info()
        assert info["weight_version"] == "7" and client.weight_version == 7
        for name, tensor in weights.items():
            got = torch.tensor(await client.get_weights_by_name(name, truncate_size=1 << 20))
            assert torch.equal(got, tensor.reshape(got.shape)), name  # fp32: bit for bit
        served = await client.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=0.0))
        local = await _greedy_of(model, weights)
        assert list(served.token_ids) == list(local.token_ids)
        assert max(abs(a - b) for a, b in zip(served.logprobs, local.logprobs, strict=True)) < 1e-4
        # the sender's tensors are untouched (it shared copies, not the trainer's storage)
        assert all(not t.is_shared() for t in weights.values())
    finally:
        await sender.close()
        await client.close()


async def test_sglang_client_tensor_format_sglang_speaks_the_same_handles(model: Path,
                                                                          server: str) -> None:
    from palaestra.engines.clients.sglang_client import SGLangClient

    weights = _new_weights(model, seed=12)
    client = SGLangClient(server, retries=0, tensor_format="sglang")
    try:
        await client.update_weights(weights, version=9)
        name = "model.norm.weight"
        got = torch.tensor(await client.get_weights_by_name(name, truncate_size=1 << 20))
        assert torch.equal(got, weights[name])
    finally:
        await client.close()


def test_body_and_payload_are_sglangs() -> None:
    """The body passes SGLang's field table; the payload is a torch multiprocessing pickle that a
    plain ``pickle.loads`` in another process (SGLang's deserialiser) turns into the pairs."""
    from palaestra.engines.serve import sglang_protocol as sp
    from palaestra.engines.weights.ipc_payload import encode_ipc_named_tensors

    pairs = [("a.weight", torch.randn(4, 3)), ("b.bias", torch.arange(5, dtype=torch.int64))]
    payload, alive = encode_ipc_named_tensors(pairs)
    body = {"serialized_named_tensors": [payload, payload], "load_format": None,
            "flush_cache": False, "abort_all_requests": False, "weight_version": "3"}
    assert set(body) <= set(sp.UPDATE_WEIGHTS_FROM_TENSOR_REQ_INPUT)
    sp.check_body(body, sp.UPDATE_WEIGHTS_FROM_TENSOR_REQ_INPUT, "UpdateWeightsFromTensorReqInput")
    code = ("import base64,pickle,sys,torch;"
            "x=pickle.loads(base64.b64decode(sys.argv[1]));"
            "print(repr([(n,t.dtype,t.tolist()) for n,t in x]))")
    out = subprocess.run([sys.executable, "-c", code, payload], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=60, check=True)
    assert out.stdout.strip() == repr([(n, t.dtype, t.tolist()) for n, t in pairs])
    assert len(alive) == 3  # the packed buffer and its two views


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("true",))


def _b64(obj: Any) -> str:
    return base64.b64encode(pickle.dumps(obj, protocol=4)).decode()


def _fd_payload() -> str:
    """CPU tensors pickled with torch's default file_descriptor strategy (what a plain
    ``ForkingPickler`` gives): only the sender's own children can open those."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing

    buf = io.BytesIO()
    ForkingPickler(buf).dump([("model.norm.weight", torch.ones(8))])
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize(("payload", "message"), [
    (_b64([("x", _Evil())]), "does not need; refused"),
    (_b64({"flattened_tensor": None, "metadata": []}), "flattened bucket"),
    (_b64([("x", 3)]), r"list of \(name, tensor\) pairs"),
    (base64.b64encode(b"hello world").decode(), "safetensors bytes or SGLang"),
])
async def test_bad_payloads_are_refused_by_the_server(server: str, payload: str,
                                                      message: str) -> None:
    from palaestra.engines.clients.sglang_client import SGLangClient

    client = SGLangClient(server, retries=0)
    try:
        with pytest.raises(EngineError, match=message):
            await client.update_weights_from_tensor(payload, version=99)
        assert (await client.get_model_info())["weight_version"] != "99"
    finally:
        await client.close()


async def test_file_descriptor_payload_is_refused_with_the_fix(server: str) -> None:
    from palaestra.engines.clients.sglang_client import SGLangClient

    client = SGLangClient(server, retries=0)
    try:
        with pytest.raises(EngineError, match="file_descriptor strategy"):
            await client.update_weights_from_tensor(_fd_payload(), version=98)
    finally:
        await client.close()


async def test_servers_elsewhere_and_bad_config_are_refused() -> None:
    from palaestra.config import validate
    from palaestra.engines.clients.sglang_client import SGLangClient
    from palaestra.engines.weights.weight_transfer import IpcWeightSender, on_this_host
    from palaestra.run.config import TrainConfig
    from palaestra.run.fleet.sync_settings import IpcSync
    from palaestra.run.fleet.engine_sync import resolve_method

    assert on_this_host("http://127.0.0.1:30000") and on_this_host("http://localhost:1")
    assert not on_this_host("http://192.0.2.7:30000")  # TEST-NET-1: never this machine
    with pytest.raises(ConfigError, match="not on this host"):
        await IpcWeightSender([SGLangClient("http://192.0.2.7:30000")]).connect()
    with pytest.raises(ConfigError, match="at least one server"):
        IpcWeightSender([])
    servers = {"kind": "sglang", "urls": ["http://127.0.0.1:30000"]}
    cfg = validate(TrainConfig, {"engine": {**servers, "weight_sync": {"kind": "ipc",
                                                                        "bucket_mb": 64}}})
    assert isinstance(cfg.engine.weight_sync, IpcSync) and cfg.engine.weight_sync.bucket_mb == 64
    assert resolve_method(cfg.engine) == "ipc"
    auto = validate(TrainConfig, {"engine": servers}).engine
    cuda = torch.cuda.is_available()
    assert resolve_method(auto, colocate=True) == ("ipc" if cuda else "disk")
    assert resolve_method(auto) == ("distributed" if cuda else "disk")
    far = validate(TrainConfig, {"engine": {"kind": "sglang", "urls": ["http://192.0.2.7:1"]}})
    assert resolve_method(far.engine, colocate=True) == ("distributed" if cuda else "disk")
    with pytest.raises(ConfigError, match="needs SGLang servers"):
        validate(TrainConfig, {"engine": {"weight_sync": {"kind": "ipc"}}})


async def test_engine_sync_ipc_from_a_torch_backend(model: Path, server: str,
                                                    tmp_path: Path) -> None:
    """``[engine.weight_sync] kind = "ipc"`` end to end: `EngineSync` pushes a real
    `TorchBackend`'s weights (changed as a step would) in small buckets to the server."""
    from palaestra.config import validate
    from palaestra.engines.clients.sglang import SGLangEngine
    from palaestra.engines.weights.weight_transfer import IpcWeightSender
    from palaestra.run.config import TrainConfig
    from palaestra.run.fleet.engine_sync import EngineSync
    from palaestra.run.fleet.weight_pushes import build_push
    from palaestra.trainers.torch_backend.backend import TorchBackend
    from palaestra.trainers.torch_backend.config import TorchBackendConfig

    backend = TorchBackend(model, TorchBackendConfig(device="cpu", seed=0))
    with torch.no_grad():
        g = torch.Generator().manual_seed(21)
        for p in backend.model.parameters():
            p.add_(0.03 * torch.randn(p.shape, generator=g))
    cfg = validate(TrainConfig, {"engine": {"kind": "sglang", "urls": [server],
                                            "weight_sync": {"kind": "ipc", "bucket_mb": 1}}})
    engine = SGLangEngine(server, retries=0)
    await engine.start()
    sync = EngineSync.from_config(cfg.engine, engine, model, out=str(tmp_path))
    try:
        assert sync.method == "ipc" and isinstance(sync.sender, IpcWeightSender)
        assert sync.bucket_bytes == 1 << 20
        sync.bucket_bytes = 32 << 10  # the micro model is ~130 KB: several buckets
        push = build_push(sync, backend)
        stats = await push.push(31)
        assert stats.num_buckets > 1 and push.metrics()["sync/unflushed_servers"] == 0.0
        want = backend.state_dict_for_engines(device="cpu")
        client = engine.clients[0]
        assert (await client.get_model_info())["weight_version"] == "31"
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight",
                     "model.embed_tokens.weight"):
            got = torch.tensor(await client.get_weights_by_name(name, truncate_size=1 << 20))
            assert torch.equal(got, want[name].reshape(got.shape)), name
        served = await engine.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=0.0))
        local = await _greedy_of(model, want)
        assert list(served.token_ids) == list(local.token_ids)
    finally:
        await sync.close()
        await engine.close()

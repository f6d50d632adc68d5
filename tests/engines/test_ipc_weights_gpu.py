"""CUDA IPC weight sync on one GPU: a trainer-side process and ``palaestra serve`` share it.

The test process plays the trainer: a random-init Qwen3-0.6B-shaped model (bf16, built as
benchmarks/perf/weight_sync.py builds it) held on cuda:0. A real ``palaestra serve`` subprocess
on the same GPU receives the weights by `IpcWeightSender` (``/update_weights_from_tensor`` with
CUDA IPC handles, 512 MiB buckets): its weights then equal the pushed ones, its version is the
pushed one, and its greedy tokens match an in-process `LocalEngine` holding those weights. The
push is timed against the ``tensor`` path (base64 safetensors over HTTP) and both are printed::

    python -m pytest tests/engines/test_ipc_weights_gpu.py -q -s
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from palaestra.engine import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
PROMPT = [3, 17, 29, 41, 5, 8, 90, 11]
CHECKED = ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight",
           "model.embed_tokens.weight", "model.layers.27.mlp.down_proj.weight")


def _change(weights: dict[str, torch.Tensor], step: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(step)
    for t in weights.values():
        t.add_(torch.randn(t.shape, generator=g, device=t.device, dtype=t.dtype), alpha=1e-3)


async def _check(client: Any, weights: dict[str, torch.Tensor]) -> None:
    for name in CHECKED:
        got = torch.tensor(await client.get_weights_by_name(name, truncate_size=8))
        want = weights[name][:8].float().cpu().reshape(got.shape)
        assert torch.equal(got, want), f"{name}: the server holds other values than were pushed"


async def test_ipc_push_to_a_colocated_server(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from palaestra.benchmarks.perf.weight_sync import build_checkpoint
    from palaestra.engines.local.local import LocalEngine
    from palaestra.engines.serve.serve import serve_process
    from palaestra.engines.clients.sglang_client import SGLangClient
    from palaestra.engines.weights.weight_transfer import IpcWeightSender, bucketize

    model = build_checkpoint("0.6b", tmp_path / "model")
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(model.glob("*.safetensors")):
        weights.update({k: v.to("cuda:0") for k, v in load_file(str(f)).items()})
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    server = serve_process(model, device="cuda", extra=(
        "--dtype", "bfloat16", "--max-running", "8", "--max-model-len", "1024"),
        env=dict(os.environ), log_path=tmp_path / "serve.log")
    client = SGLangClient(server.url, retries=0)
    sender = IpcWeightSender([client])
    ipc_s: list[float] = []
    tensor_s: list[float] = []
    try:
        await server.wait_ready(600)
        for step in range(3):
            _change(weights, step)
            stats = await sender.push(bucketize(weights.items(), 512 << 20), version=step + 1)
            ipc_s.append(stats.seconds)
            assert (await client.get_model_info())["weight_version"] == str(step + 1)
            await _check(client, weights)
        assert stats.num_buckets >= 2 and stats.num_bytes == nbytes
        served = await client.generate(PROMPT, SamplingParams(max_new_tokens=12, temperature=0.0))
        local = LocalEngine(str(model), device="cuda:0", dtype=torch.bfloat16, max_running=8,
                            max_model_len=1024)  # beside the server: the same GPU
        try:
            await local.update_weights(weights, version=3)
            want = await local.generate(PROMPT, SamplingParams(max_new_tokens=12,
                                                               temperature=0.0))
        finally:
            await local.close()
        assert list(served.token_ids) == list(want.token_ids)
        for step in range(2):  # the tensor path: base64 safetensors of host copies, whole model
            _change(weights, 10 + step)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            await client.update_weights(weights, version=20 + step)
            tensor_s.append(time.perf_counter() - t0)
            await _check(client, weights)
    finally:
        await sender.close()
        await client.close()
        server.stop()
    print(f"\nqwen3-0.6b shape, {nbytes / 1e9:.2f} GB bf16, one GPU: ipc push "
          f"{statistics.median(ipc_s):.3f} s ({nbytes / 1e9 / statistics.median(ipc_s):.1f} GB/s,"
          f" {stats.num_buckets} buckets of 512 MiB), tensor (base64 HTTP) push "
          f"{statistics.median(tensor_s):.3f} s; ipc runs {ipc_s}, tensor runs {tensor_s}")

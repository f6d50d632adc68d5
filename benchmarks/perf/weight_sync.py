"""Weight sync to rollout engines, every path, timed: in process, NCCL broadcast, disk, HTTP.

Launch on a machine with two GPUs, from the repository root::

    python -m palaestra.benchmarks.perf.weight_sync --models 0.6b,1.7b --json out.json

For each Qwen3-shaped random model (bf16, vocabulary 151936) the "trainer" holds the weights on
GPU 0 and pushes them (changed before every push) to:

* ``in_process``: a `LocalEngine` on GPU 0 in this process (the colocated path);
* ``nccl``: a `palaestra serve` process on GPU 1 through SGLang's weight-update group
  (`DistributedWeightSender`; the group is formed once, its setup timed apart);
* ``disk``: the same server through ``/update_weights_from_disk`` (`DiskWeightSender`, local disk);
* ``ipc``: the same server through ``/update_weights_from_tensor`` with CUDA IPC handles
  (`IpcWeightSender`; the server must see GPU 0: ``--server-gpu 0`` puts it on the trainer's
  GPU, the colocated case (no nccl row then: NCCL refuses two ranks on one GPU), ``1,0`` on
  another GPU of the host, the copies going peer to peer);
* ``http_tensor``: base64 safetensors through ``/update_weights_from_tensor`` (small models only).

Every push is checked: a few weights are read back (``/get_weights_by_name``) and must equal the
pushed bf16 values exactly. Prints a table (median of ``--reps``) and writes JSON. ``--smoke``
runs the same code on the CPU (a tiny model, gloo instead of NCCL) to check the script itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

CHECKED = ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight", "model.embed_tokens.weight")


def build_checkpoint(name: str, out: Path) -> Path:
    """A random-init bf16 Qwen3 model of that shape, with a small local tokenizer."""
    import torch
    import transformers

    from palaestra.benchmarks.perf.megatron import qwen3_config
    from palaestra.tiny_model import build_model, build_tokenizer

    if name == "tiny":
        return build_model(out, "tiny")
    build_tokenizer().save_pretrained(out)
    cfg = transformers.Qwen3Config(**{k: v for k, v in qwen3_config(name).items()
                                      if k != "model_type"},
                                   torch_dtype="bfloat16")  # type: ignore[call-arg]  # 4's name; 5 reads it
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    return out


async def _check(read: Any, weights: dict[str, Any], dtype: Any) -> None:
    import torch

    for name in CHECKED:
        got = torch.tensor(await read(name))
        want = weights[name][:4].to(dtype).float().cpu()
        if not torch.equal(got, want):
            raise AssertionError(f"{name}: the engine holds other values than were pushed")


async def bench_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    from palaestra.engines.local.local import LocalEngine
    from palaestra.engines.serve.serve import serve_process
    from palaestra.engines.clients.sglang_client import SGLangClient
    from palaestra.engines.weights.disk_sender import DiskWeightSender
    from palaestra.engines.weights.weight_transfer import (
        DistributedWeightSender,
        IpcWeightSender,
        bucketize,
    )

    work = Path(tempfile.mkdtemp(prefix=f"wsync-{name}-", dir=args.workdir))
    model_dir = build_checkpoint(name, work / "model")
    device, dtype, backend = ("cpu", torch.float32, "gloo") if args.smoke else \
        ("cuda:0", torch.bfloat16, "nccl")
    weights = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update({k: v.to(device) for k, v in load_file(str(f)).items()})
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    row: dict[str, Any] = {"model": f"qwen3-{name}", "gbytes": nbytes / 1e9,
                           "tensors": len(weights), "bucket_mb": args.bucket_mb}
    bucket = args.bucket_mb << 20

    def change() -> None:
        for t in weights.values():
            t.add_(1.0 / 64)  # every push carries new values

    def synchronize() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    # colocated: an engine in this process on the trainer's device
    engine = LocalEngine(model_dir, device=device, dtype=dtype, max_running=8,
                         max_model_len=2048)

    async def local_weight(n: str, engine: Any = engine) -> Any:
        return engine.get_weight(n, 4)

    times = []
    for v in range(args.reps):
        change()
        synchronize()
        t0 = time.perf_counter()
        await engine.update_weights(weights, version=v + 1)
        synchronize()
        times.append(time.perf_counter() - t0)
        await _check(local_weight, weights, dtype)
    row["in_process_s"] = statistics.median(times)
    await engine.close()
    del engine, local_weight  # free its GPU memory before the server starts
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    server = serve_process(model_dir, device=device.split(":")[0],
                           extra=("--dtype", str(dtype).removeprefix("torch."),
                                  "--max-running", "8", "--max-model-len", "2048"),
                           env=dict(os.environ, CUDA_VISIBLE_DEVICES=args.server_gpu),
                           log_path=work / "serve.log")
    client = SGLangClient(server.url, retries=0)
    try:
        await server.wait_ready(600)
        times, version = [], 10
        # NCCL refuses two ranks on one GPU: a server on the trainer's GPU gets no nccl row
        if args.smoke or args.server_gpu.split(",")[0] != "0":
            sender = DistributedWeightSender([client], backend=backend)
            t0 = time.perf_counter()
            await sender.connect()
            row["nccl_group_setup_s"] = time.perf_counter() - t0
            times, version = [], 10
            for _ in range(args.reps):
                change()
                version += 1
                stats = await sender.push(bucketize(weights.items(), bucket), version)
                times.append(stats.seconds)
                await _check(lambda n: client.get_weights_by_name(n, 4), weights, dtype)
            row["nccl_s"] = statistics.median(times)
            row["nccl_backend"] = backend
            row["nccl_buckets"] = stats.num_buckets
            await sender.close()

        disk = DiskWeightSender([client], work / "pushed", model_dir=model_dir)
        await disk.connect()
        times = []
        for _ in range(max(1, args.reps - 1)):
            change()
            version += 1
            times.append((await disk.push(bucketize(weights.items(), bucket), version)).seconds)
            await _check(lambda n: client.get_weights_by_name(n, 4), weights, dtype)
        row["disk_s"] = statistics.median(times)

        # CUDA IPC maps GPU 0's memory: the server must see GPU 0 (``--server-gpu 0``: the
        # colocated case; "1,0": another GPU of the host, peer to peer)
        if args.smoke or "0" in args.server_gpu.split(","):
            ipc = IpcWeightSender([client])
            change()  # the first push starts torch's shm manager / opens the CUDA context: apart
            version += 1
            first = await ipc.push(bucketize(weights.items(), bucket), version)
            row["ipc_first_s"] = first.seconds
            times = []
            for _ in range(args.reps):
                change()
                version += 1
                times.append((await ipc.push(bucketize(weights.items(), bucket), version)).seconds)
                await _check(lambda n: client.get_weights_by_name(n, 4), weights, dtype)
            row["ipc_s"] = statistics.median(times)

        if nbytes <= args.http_max_gb * 1e9:
            change()
            version += 1
            t0 = time.perf_counter()
            await client.update_weights({k: v.cpu() for k, v in weights.items()}, version=version)
            row["http_tensor_s"] = time.perf_counter() - t0
            await _check(lambda n: client.get_weights_by_name(n, 4), weights, dtype)
    finally:
        await client.close()
        server.stop()
    for key in ("in_process", "nccl", "ipc", "disk", "http_tensor"):
        if f"{key}_s" in row:
            row[f"{key}_gbytes_per_s"] = nbytes / 1e9 / row[f"{key}_s"]
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'model':<13}{'GB':>6}{'path':>14}{'seconds':>10}{'GB/s':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        for key in ("in_process", "nccl", "ipc", "disk", "http_tensor"):
            if f"{key}_s" in r:
                print(f"{r['model']:<13}{r['gbytes']:>6.2f}{key:>14}{r[f'{key}_s']:>10.3f}"
                      f"{r[f'{key}_gbytes_per_s']:>8.1f}")
        if "nccl_group_setup_s" in r:
            print(f"{'':<13}{'':>6}{'nccl setup':>14}{r['nccl_group_setup_s']:>10.3f}")
        if "ipc_first_s" in r:
            print(f"{'':<13}{'':>6}{'ipc first':>14}{r['ipc_first_s']:>10.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="0.6b,1.7b", help="comma list: 0.6b, 1.7b, 4b")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--server-gpu", default="1", help="CUDA_VISIBLE_DEVICES of the server")
    parser.add_argument("--http-max-gb", type=float, default=1.5,
                        help="time the HTTP tensor path only for models up to this size")
    parser.add_argument("--workdir", default=None, help="where checkpoints and pushes go")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU check of this script: tiny model, gloo, float32")
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.reps = "tiny", 2
    rows = []
    for name in args.models.split(","):
        rows.append(asyncio.run(bench_model(name.strip(), args)))
        print_table(rows[-1:])
    print()
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``palaestra tinker-server``: serve a local model with the Tinker API.

    palaestra init-model --out runs/tiny-model --size tiny
    palaestra tinker-server --model runs/tiny-model --port 8000

then, with the ``tinker`` SDK: ``tinker.ServiceClient(base_url="http://127.0.0.1:8000",
api_key="tml-local")`` (the SDK wants a key that starts with ``tml-``; the server checks it only
with ``--api-key``). The base model is served under the ``--base-model-name`` names and under
the model folder's absolute path. Needs the ``tinker`` extra: ``pip install
'palaestra[tinker]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

INSTALL_HINT = ("palaestra tinker-server needs the tinker SDK (its protobuf module and types): "
                "pip install 'palaestra[tinker]' (or pip install tinker==0.38.0)")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face model folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--base-model-name", action="append", default=[], metavar="NAME",
                        help="a name the base model is served under (repeatable), e.g. the "
                             "name a recipe asks for")
    parser.add_argument("--api-key", default=None,
                        help="require this key in X-API-Key (start it with tml-: the SDK "
                             "refuses other keys)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--dtype", default=None,
                        help="trainer dtype (default float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where checkpoints are written (default: a new temporary folder)")
    parser.add_argument("--max-batch-datums", type=int, default=1024)
    parser.add_argument("--max-batch-tokens", type=int, default=65536)
    parser.add_argument("--max-num-samples", type=int, default=128)
    parser.add_argument("--max-running", type=int, default=64,
                        help="the engine's running batch (sequences sampled at once)")
    parser.add_argument("--snapshots-kept", type=int, default=8,
                        help="sampler snapshots kept loaded per training client")


async def _serve(args: argparse.Namespace) -> int:
    from palaestra.tinker_api.listen import start_server
    from palaestra.tinker_api.server import ServerConfig

    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    config = ServerConfig(
        args.model, tuple(args.base_model_name), args.host, args.port, args.api_key, device,
        args.dtype, args.checkpoint_dir, args.max_running, args.max_batch_datums,
        args.max_batch_tokens, args.max_num_samples, max(1, args.snapshots_kept))
    running = await start_server(config)
    names = ", ".join(config.names)
    print(f"palaestra tinker-server: {names} on {running.url} ({device}); checkpoints in "
          f"{running.server.registry.root}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await running.stop()
    print("palaestra tinker-server: stopped", flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        import tinker.proto.tinker_public_pb2  # noqa: F401  (the extra's protobuf module)
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    from palaestra.tinker_api.errors import ApiError

    try:
        return asyncio.run(_serve(args))
    except ApiError as exc:
        print(f"palaestra tinker-server: {exc.message}", file=sys.stderr)
        return 2


__all__ = ["INSTALL_HINT", "configure", "run"]

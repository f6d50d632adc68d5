"""``palaestra serve``: the embedded engine behind SGLang's native HTTP API and an OpenAI API.

    palaestra serve --model runs/tiny-model --port 30000

then ``SGLangEngine(urls=["http://127.0.0.1:30000"])``, ``curl .../generate -d '{"input_ids":
[1, 2, 3], "sampling_params": {"max_new_tokens": 8}}'`` or any OpenAI client with
``base_url="http://127.0.0.1:30000/v1"``. `start_server` runs the same server inside a running
event loop (tests, notebooks); `serve_argv` / `serve_process` start it as a separate process
(launched servers of a training run, tests, benchmarks). Nothing heavy is imported until the
command runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiohttp import web

    from palaestra.rollout.engines.local import LocalEngine
    from palaestra.rollout.engines.sglang import ServerProcess


@dataclass
class RunningServer:
    """A server started by `start_server`; ``await close()`` stops it (not the engine)."""

    url: str
    runner: web.AppRunner
    app: web.Application

    async def close(self) -> None:
        await self.runner.cleanup()

    async def kill(self) -> None:
        """Stop abruptly, as a crashed server would: open connections are reset."""
        for site in list(self.runner.sites):
            await site.stop()
        server = self.runner.server
        for handler in list(server.connections if server is not None else ()):
            transport = handler.transport
            if transport is not None:
                transport.abort()
        await self.runner.cleanup()


async def start_server(engine: LocalEngine, *, host: str = "127.0.0.1", port: int = 0,
                       tokenizer: Any = None, model_name: str | None = None) -> RunningServer:
    """Serve ``engine`` on ``host:port`` (0 = a free port) inside the running event loop."""
    from aiohttp import web

    from palaestra.rollout.engines.http_server import ServerState, build_app

    tok = tokenizer if tokenizer is not None else engine.tokenizer
    path = engine.model_path or "in-memory"
    state = ServerState(engine=engine, tokenizer=tok, model_path=path,
                        model_name=model_name or path.rstrip("/").split("/")[-1], host=host)
    app = build_app(state)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts the
    # request in the engine (its slot is freed), as SGLang does
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sockets = site._server.sockets if site._server is not None else []  # type: ignore[union-attr]
    state.port = sockets[0].getsockname()[1] if sockets else port
    return RunningServer(url=f"http://{host}:{state.port}", runner=runner, app=app)


def serve_argv(model: str | Path, *, port: int, device: str | None = None,
               host: str = "127.0.0.1", extra: Sequence[str] = ()) -> list[str]:
    """The command line of a ``palaestra serve`` process (this Python, ``-m palaestra``)."""
    argv = [sys.executable, "-m", "palaestra", "serve", "--model", str(model), "--host", host,
            "--port", str(port)]
    if device is not None:
        argv += ["--device", device]
    return argv + list(extra)


def serve_process(model: str | Path, *, device: str | None = None, extra: Sequence[str] = (),
                  env: Mapping[str, str] | None = None,
                  log_path: str | Path | None = None) -> ServerProcess:
    """A ``palaestra serve`` process on a free loopback port (``await p.wait_ready(timeout)``)."""
    from palaestra.rollout.engines.sglang import ServerProcess
    from palaestra.rollout.engines.weight_transfer import free_port

    port = free_port()
    return ServerProcess(serve_argv(model, port=port, device=device, extra=extra),
                         f"http://127.0.0.1:{port}", env=env, log_path=log_path)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=30000, help="port (0 = any free port)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    parser.add_argument("--max-running", type=int, default=64, help="running batch size bound")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length bound")
    parser.add_argument("--max-prefill-tokens", type=int, default=4096,
                        help="tokens computed by one prefill step")
    parser.add_argument("--prefix-cache-tokens", type=int, default=32768,
                        help="tokens of finished requests kept for prefix reuse (0 = off)")
    parser.add_argument("--served-model-name", default=None, help="name in /v1/models")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of the engine")


def run(args: argparse.Namespace) -> int:
    import asyncio

    from palaestra.asyncio_utils import wait_for_stop_signal

    async def main() -> None:
        import torch

        from palaestra.rollout.engines.local import LocalEngine

        if args.threads:
            torch.set_num_threads(args.threads)
        engine = LocalEngine(
            args.model, device=args.device, dtype=args.dtype, max_running=args.max_running,
            max_model_len=args.max_model_len, max_prefill_tokens=args.max_prefill_tokens,
            prefix_cache_tokens=args.prefix_cache_tokens, seed=args.seed,
        )
        server = await start_server(engine, host=args.host, port=args.port,
                                    model_name=args.served_model_name)
        print(f"palaestra serve: {args.model} on {server.url} ({engine.device})", flush=True)
        await wait_for_stop_signal()
        await server.close()
        await engine.close()

    asyncio.run(main())
    return 0


__all__ = ["RunningServer", "configure", "run", "serve_argv", "serve_process", "start_server"]

"""``palaestra serve``: the embedded engine behind SGLang's native HTTP API and an OpenAI API.

    palaestra serve --model runs/tiny-model --port 30000

then ``SGLangEngine(urls=["http://127.0.0.1:30000"])``, ``curl .../generate -d '{"input_ids":
[1, 2, 3], "sampling_params": {"max_new_tokens": 8}}'`` or any OpenAI client with
``base_url="http://127.0.0.1:30000/v1"``. `start_server` runs the same server inside a running
event loop (tests, notebooks); `serve_argv` / `serve_process` start it as a separate process
(launched servers of a training run, tests, benchmarks). Nothing heavy is imported until the
command runs.

Guards (`serve_guard`, `serve_requests`): ``--api-key`` / ``--admin-api-key`` (Bearer; keyless by
default, with a warning when bound beyond loopback), ``--max-n``, ``--max-batch``,
``--max-new-tokens``, ``--max-body-mb``. SIGTERM or SIGINT drains: the port closes, new requests on
open connections get 503, requests in flight have ``--shutdown-grace-s`` to finish, then they are
aborted (streams end with an error event and ``[DONE]``), and the process exits; a second signal
skips the grace, and a watchdog ends the process if the drain itself hangs.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio

    from aiohttp import web

    from palaestra.contracts import Tokenizer
    from palaestra.engines.serve.server_state import ServerState
    from palaestra.engines.local.local import LocalEngine
    from palaestra.engines.serve.serve_guard import ServeOptions
    from palaestra.engines.clients.server_process import ServerProcess


@dataclass
class RunningServer:
    """A server started by `start_server`; ``await close()`` stops it (not the engine)."""

    url: str
    runner: web.AppRunner
    app: web.Application
    state: ServerState
    closed: bool = False

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await self.runner.cleanup()

    async def drain(self, grace_s: float | None = None, stop: asyncio.Event | None = None
                    ) -> bool:
        """Graceful stop: close the port, refuse new requests (503), let those in flight finish
        within ``grace_s`` (the server's option by default; ``stop`` set cuts it short), then
        abort the rest (they answer with an abort / error event and ``[DONE]``) and close.
        Whether everything finished within the grace period."""
        import asyncio

        state = self.state
        state.draining = True
        for site in list(self.runner.sites):
            await site.stop()
        grace = state.options.shutdown_grace_s if grace_s is None else grace_s
        finished = await _wait_idle(state, grace, stop)
        if not finished:
            state.aborting = True
            await state.engine.abort(None)
            await state.wait_idle(5.0)  # handlers write their abort answers
        await asyncio.sleep(0)
        await self.close()
        return finished

    async def kill(self) -> None:
        """Stop abruptly, as a crashed server would: open connections are reset."""
        for site in list(self.runner.sites):
            await site.stop()
        server = self.runner.server
        for handler in list(server.connections if server is not None else ()):
            transport = handler.transport
            if transport is not None:
                transport.abort()
        await self.close()


async def _wait_idle(state: ServerState, grace_s: float, stop: asyncio.Event | None) -> bool:
    import asyncio

    if stop is None:
        return await state.wait_idle(grace_s)
    idle = asyncio.ensure_future(state.wait_idle(grace_s))
    cut = asyncio.ensure_future(stop.wait())
    await asyncio.wait({idle, cut}, return_when=asyncio.FIRST_COMPLETED)
    cut.cancel()
    if not idle.done():
        idle.cancel()
        return False
    return idle.result()


async def start_server(engine: LocalEngine, *, host: str = "127.0.0.1", port: int = 0,
                       tokenizer: Tokenizer | None = None, model_name: str | None = None,
                       options: ServeOptions | None = None) -> RunningServer:
    """Serve ``engine`` on ``host:port`` (0 = a free port) inside the running event loop."""
    from aiohttp import web

    from palaestra.engines.serve.http_server import build_app
    from palaestra.engines.serve.server_state import ServerState
    from palaestra.engines.serve.serve_guard import ServeOptions

    tok = tokenizer if tokenizer is not None else engine.tokenizer
    path = engine.model_path or "in-memory"
    state = ServerState(engine=engine, tokenizer=tok, model_path=path,
                        model_name=model_name or path.rstrip("/").split("/")[-1], host=host,
                        options=options or ServeOptions())
    if tok is not None:
        await state.run(state.warm_up)
    app = build_app(state)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts the
    # request in the engine (its slot is freed), as SGLang does
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sockets = getattr(site._server, "sockets", None) or []  # aiohttp's bound sockets
    state.port = sockets[0].getsockname()[1] if sockets else port
    shown = f"[{host}]" if ":" in host else host
    return RunningServer(url=f"http://{shown}:{state.port}", runner=runner, app=app, state=state)


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
    from palaestra.engines.clients.server_process import ServerProcess
    from palaestra.engines.weights.weight_transfer import free_port

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
    guard = parser.add_argument_group("limits and access")
    guard.add_argument("--api-key", default=None,
                       help="key every route but /health needs (Authorization: Bearer KEY); "
                       "also read from $PALAESTRA_SERVE_API_KEY")
    guard.add_argument("--admin-api-key", default=None,
                       help="key of the weight, group, cache, memory, pause and abort routes; "
                       "also read from $PALAESTRA_SERVE_ADMIN_API_KEY")
    guard.add_argument("--max-n", type=int, default=128, help="samples per request (n)")
    guard.add_argument("--max-batch", type=int, default=1024,
                       help="sequences per request (prompts x n)")
    guard.add_argument("--max-new-tokens", type=int, default=None,
                       help="tokens per sequence (default: the context length)")
    guard.add_argument("--max-body-mb", type=float, default=32.0, help="request body limit")
    guard.add_argument("--max-weights-body-mb", type=float, default=4096.0,
                       help="body limit of /update_weights_from_tensor (it carries weights)")
    guard.add_argument("--shutdown-grace-s", type=float, default=5.0,
                       help="after SIGTERM, how long requests in flight may finish")
    guard.add_argument("--weight-group-timeout-s", type=float, default=120.0,
                       help="bound on a weight-group rendezvous and on each broadcast")
    guard.add_argument("--weight-group-connect-timeout-s", type=float, default=10.0,
                       help="how long a joining server waits for the trainer's store to listen")


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    """The `ServeOptions` of a parsed ``palaestra serve`` command line."""
    import os

    from palaestra.engines.serve.serve_guard import ServeOptions
    from palaestra.engines.serve.serve_requests import ServeLimits

    return ServeOptions(
        limits=ServeLimits(max_n=args.max_n, max_batch=args.max_batch,
                           max_new_tokens=args.max_new_tokens),
        api_key=args.api_key or os.environ.get("PALAESTRA_SERVE_API_KEY") or None,
        admin_api_key=args.admin_api_key or os.environ.get("PALAESTRA_SERVE_ADMIN_API_KEY")
        or None,
        max_body_mb=args.max_body_mb, max_weights_body_mb=args.max_weights_body_mb,
        shutdown_grace_s=args.shutdown_grace_s,
        weight_group_timeout_s=args.weight_group_timeout_s,
        weight_group_connect_timeout_s=args.weight_group_connect_timeout_s,
    )


def _watchdog(seconds: float) -> None:
    """End the process if the drain has not within ``seconds`` (a hung handler or engine)."""
    import os
    import threading

    def kill() -> None:
        print(f"palaestra serve: the shutdown did not finish within {seconds:g} s; exiting",
              file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(seconds, kill)
    timer.daemon = True
    timer.start()


class _Http2ProbeFilter:
    """Drops aiohttp's traceback for a connection that opened with HTTP/2's preface (``PRI *
    HTTP/2.0``): the SGLang router probes every worker for gRPC beside HTTP when it registers
    it, and this server answers HTTP/1.1 only (the router then uses HTTP); one line says so."""

    def __init__(self) -> None:
        self.noted = False

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or "PRI/Upgrade" not in str(exc):
            return True
        if not self.noted:
            self.noted = True
            print("palaestra serve: a client probed for HTTP/2 (gRPC); this server speaks "
                  "HTTP/1.1 (the SGLang router falls back to it)", file=sys.stderr, flush=True)
        return False


def run(args: argparse.Namespace) -> int:
    import asyncio
    import gc
    import os
    import signal

    from palaestra.engines.serve.serve_guard import exposure_warning

    # Requests are concurrent already: a tokenizer that fans each small encode out to its own
    # thread pool only makes the event loop wait for those threads on a busy machine.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    options = options_from_args(args)  # bad options fail before the model loads
    logging.getLogger("aiohttp.server").addFilter(_Http2ProbeFilter())
    warning = exposure_warning(args.host, options)
    if warning:
        print(f"WARNING: {warning}", file=sys.stderr, flush=True)

    async def main() -> None:
        import torch

        from palaestra.engines.local.local import LocalEngine

        # The event loop shares the GIL with the engine's and the tokenizer's threads; it gives
        # it up at every socket call and, by default, waits up to 5 ms to get it back each time.
        # 1 ms keeps /health and small requests fast while those threads are busy.
        sys.setswitchinterval(0.001)
        if args.threads:
            torch.set_num_threads(args.threads)
        engine = LocalEngine(
            args.model, device=args.device, dtype=args.dtype, max_running=args.max_running,
            max_model_len=args.max_model_len, max_prefill_tokens=args.max_prefill_tokens,
            prefix_cache_tokens=args.prefix_cache_tokens, seed=args.seed,
        )
        server = await start_server(engine, host=args.host, port=args.port,
                                    model_name=args.served_model_name, options=options)
        # The model, torch and transformers leave millions of long-lived objects: a full
        # garbage collection walks them all and stops the event loop for a few hundred ms.
        # Frozen, they are never scanned again; requests' garbage is collected as usual.
        gc.collect()
        gc.freeze()
        print(f"palaestra serve: {args.model} on {server.url} ({engine.device})", flush=True)
        stop, again = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            (again if stop.is_set() else stop).set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        await stop.wait()
        _watchdog(options.shutdown_grace_s + 15.0)
        print("palaestra serve: draining", flush=True)
        finished = await server.drain(stop=again)
        await engine.close()
        print(f"palaestra serve: stopped ({'drained' if finished else 'aborted in-flight'})",
              flush=True)

    asyncio.run(main())
    return 0


__all__ = [
    "RunningServer",
    "configure",
    "options_from_args",
    "run",
    "serve_argv",
    "serve_process",
    "start_server",
]

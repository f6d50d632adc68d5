"""``palaestra gateway``: the OpenAI-compatible agent gateway in front of engine servers.

    palaestra serve --model runs/tiny-model --port 30000 &
    palaestra gateway --engine http://127.0.0.1:30000 --tokenizer runs/tiny-model --port 8900

then, per episode, ``POST /sessions`` (-> ``base_url``), point any OpenAI client at that base
URL, and ``POST /sessions/{id}/finish`` with the reward and group id to put the recorded samples
into the trajectory buffer (or ``DELETE`` it); external generators post finished trajectories to
``/trajectories``. ``--auto-sessions`` creates a session on first use of an unknown id. Nothing
heavy is imported until the command runs.

Tokens per sample (``--max-context``) default to the engines' context length (the smallest, asked
at start; see `palaestra.rollout.gateway.engine_info`); a larger ``--max-context`` is refused.
Posted trajectories are bounded by it and by ``--max-group-size``, ``--max-metadata-kb`` and
``--max-body-mb``. ``--api-key`` / ``--admin-api-key`` (or ``PALAESTRA_API_KEY`` /
``PALAESTRA_ADMIN_API_KEY``) require ``Authorization: Bearer <key>`` as SGLang does: the API key
on every route but ``/health``, the admin key (else the API key) on ``/trajectories/take`` and
``/trajectories/claim``.
"""

from __future__ import annotations

import argparse
import os


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", action="append", required=True, metavar="URL",
                        help="engine server URL (SGLang or `palaestra serve`); repeat for several")
    parser.add_argument("--tokenizer", required=True,
                        help="the policy's model directory (tokenizer and chat template)")
    parser.add_argument("--family", default="qwen",
                        help="model family of the chat template and tool-call parser")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=8900, help="port (0 = any free port)")
    parser.add_argument("--unix-socket", default=None, help="also listen on this Unix socket")
    parser.add_argument("--model-name", default="policy", help="the model name in /v1/models")
    parser.add_argument("--max-context", type=int, default=None,
                        help="tokens per sample (default: the engines' context length; at most it)")
    parser.add_argument("--max-tokens", type=int, default=1024,
                        help="largest completion per call (requests may ask for less)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling")
    parser.add_argument("--honor-client-sampling", action="store_true",
                        help="take temperature/top_p/top_k/seed from the requests (evaluation)")
    parser.add_argument("--auto-sessions", action="store_true",
                        help="create a session when a request names an unknown one")
    parser.add_argument("--group-size", type=int, default=None,
                        help="trajectories per group in the buffer (default: per post)")
    parser.add_argument("--max-group-size", type=int, default=1024,
                        help="most trajectories one group may hold")
    parser.add_argument("--max-metadata-kb", type=float, default=64,
                        help="largest metadata object of a trajectory or session, in KiB")
    parser.add_argument("--max-body-mb", type=float, default=64,
                        help="largest request body, in MiB (413 above it)")
    parser.add_argument("--api-key", default=os.environ.get("PALAESTRA_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (env PALAESTRA_API_KEY)")
    parser.add_argument("--admin-api-key", default=os.environ.get("PALAESTRA_ADMIN_API_KEY"),
                        help="key of /trajectories/take and /claim (env PALAESTRA_ADMIN_API_KEY)")


def run(args: argparse.Namespace) -> int:
    import asyncio

    from palaestra.errors import ConfigError

    for name in ("max_group_size", "max_metadata_kb", "max_body_mb"):
        if not getattr(args, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive")
    asyncio.run(_main(args))
    return 0


async def _main(args: argparse.Namespace) -> None:
    from palaestra.agents import load_tokenizer
    from palaestra.asyncio_utils import wait_for_stop_signal
    from palaestra.errors import ConfigError
    from palaestra.engine import EngineUnavailableError, SamplingParams
    from palaestra.engines.clients.router import Router
    from palaestra.engines.clients.sglang_client import SGLangClient
    from palaestra.rollout.gateway.auth import GatewayKeys
    from palaestra.rollout.gateway.buffer import TrajectoryBuffer
    from palaestra.rollout.gateway.engine_info import engine_context, resolve_max_context
    from palaestra.rollout.gateway.gateway import Gateway
    from palaestra.rollout.gateway.server import serve_gateway

    tokenizer = load_tokenizer(args.tokenizer)
    engine = Router([SGLangClient(url) for url in args.engine])
    try:
        try:
            found = await engine_context(engine)
        except EngineUnavailableError as exc:
            if args.max_context is None:
                raise ConfigError(f"cannot ask the engine for its context length ({exc}); "
                                  "start it first, or give --max-context") from None
            found = None
        max_context = resolve_max_context(args.max_context, found, ", ".join(args.engine))
        sampling = SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature,
                                  top_p=args.top_p)
        gateway = Gateway(engine, tokenizer, args.family, model_name=args.model_name,
                          sampling=sampling, max_context=max_context,
                          honor_client_sampling=args.honor_client_sampling,
                          auto_sessions=args.auto_sessions)
        buffer = TrajectoryBuffer(vocab_size=len(tokenizer), group_size=args.group_size,
                                  max_tokens=max_context, max_group_size=args.max_group_size,
                                  max_metadata_bytes=int(args.max_metadata_kb * 1024))
        keys = GatewayKeys(args.api_key or None, args.admin_api_key or None)
        warning = keys.warning(args.host)
        if warning:
            print(warning, flush=True)
        server = await serve_gateway(gateway, host=args.host, port=args.port,
                                     unix_path=args.unix_socket, buffer=buffer, keys=keys,
                                     max_body_mb=args.max_body_mb)
        print(f"palaestra gateway: {server.url} -> {', '.join(args.engine)} "
              f"(context {max_context} tokens)", flush=True)
        await wait_for_stop_signal()
        await server.close()
    finally:
        await engine.close()


__all__ = ["configure", "run"]

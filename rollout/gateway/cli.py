"""``palaestra gateway``: the OpenAI-compatible agent gateway in front of engine servers.

    palaestra serve --model runs/tiny-model --port 30000 &
    palaestra gateway --engine http://127.0.0.1:30000 --tokenizer runs/tiny-model --port 8900

then, per episode, ``POST /sessions`` (-> ``base_url``), point any OpenAI client at that base
URL, and ``POST /sessions/{id}/finish`` with the reward and group id to put the recorded samples
into the trajectory buffer (or ``DELETE`` it); external generators post finished trajectories to
``/trajectories``. ``--auto-sessions`` creates a session on first use of an unknown id. Nothing
heavy is imported until the command runs.
"""

from __future__ import annotations

import argparse


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
    parser.add_argument("--max-context", type=int, default=4096, help="tokens per sample")
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


def run(args: argparse.Namespace) -> int:
    import asyncio

    from palaestra.agents import load_tokenizer
    from palaestra.asyncio_utils import wait_for_stop_signal
    from palaestra.rollout.engines.base import SamplingParams
    from palaestra.rollout.engines.router import Router
    from palaestra.rollout.engines.sglang import SGLangClient
    from palaestra.rollout.gateway.buffer import TrajectoryBuffer
    from palaestra.rollout.gateway.gateway import Gateway
    from palaestra.rollout.gateway.server import serve_gateway

    async def main() -> None:
        tokenizer = load_tokenizer(args.tokenizer)
        engine = Router([SGLangClient(url) for url in args.engine])
        sampling = SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature,
                                  top_p=args.top_p)
        gateway = Gateway(engine, tokenizer, args.family, model_name=args.model_name,
                          sampling=sampling, max_context=args.max_context,
                          honor_client_sampling=args.honor_client_sampling,
                          auto_sessions=args.auto_sessions)
        buffer = TrajectoryBuffer(vocab_size=len(tokenizer), group_size=args.group_size)
        server = await serve_gateway(gateway, host=args.host, port=args.port,
                                     unix_path=args.unix_socket, buffer=buffer)
        print(f"palaestra gateway: {server.url} -> {', '.join(args.engine)}", flush=True)
        await wait_for_stop_signal()
        await server.close()
        await engine.close()

    asyncio.run(main())
    return 0


__all__ = ["configure", "run"]

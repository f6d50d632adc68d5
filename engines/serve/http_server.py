"""The aiohttp app of `palaestra serve`: SGLang's native HTTP API over a `LocalEngine`.

Endpoints, request bodies and responses follow SGLang's ``http_server.py`` and ``io_struct.py``
(field tables in `sglang_protocol`), so `SGLangEngine` and any SGLang client talk to this server
as to SGLang itself. Differences, all answered with a clear 400: ``/update_weights_from_tensor``
takes SGLang's CUDA IPC / shared-memory pickles (`ipc_payload`, same host) and also base64
safetensors payloads (see `tensor_payload`), weight-update groups (`weight_group`)
take "nccl" on a CUDA engine and also "gloo" (CPU), and multimodal inputs, LoRA, prompt logprobs
and grammars are refused.

`build_app` puts the guard (keys, shutdown, errors in each route's shape) in front of the
route modules: `routes_generate`, `routes_weights`, `routes_control`, and the OpenAI-compatible
`openai_api` and `completions_api` (what those two share: `openai_common`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from palaestra.errors import ConfigError, EngineError
from palaestra.engine import EngineUnavailableError
from palaestra.engines.serve.server_state import (
    SHUTDOWN_MESSAGE,
    ServerState,
    error_response,
)
from palaestra.engines.serve.routes_control import add_control_routes
from palaestra.engines.serve.routes_generate import add_generation_routes
from palaestra.engines.serve.routes_weights import add_weight_routes
from palaestra.engines.serve.serve_requests import BadRequest

if TYPE_CHECKING:
    from aiohttp import web

Handler = Callable[["web.Request"], Awaitable["web.StreamResponse"]]


def build_app(state: ServerState) -> web.Application:
    """The aiohttp application with SGLang's native routes and the OpenAI-compatible ones."""
    from aiohttp import web

    from palaestra.engines.serve import completions_api, openai_api, openai_common

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        """Keys, the shutdown gate, the in-flight count, and errors in the route's shape."""
        from palaestra.engines.serve.serve_guard import OPEN_PATHS, bearer, refusal

        openai_route = request.path.startswith("/v1/")

        def fail(message: str, status: int, param: str | None = None,
                 code: str | None = None) -> web.Response:
            if openai_route:
                return openai_common.error(message, status, param, code)
            return error_response(message, status, param)

        refused = refusal(state.options, request.path, bearer(request))
        if refused is not None:
            status, message, code = refused
            return fail(message, status, None, code)
        if request.path in OPEN_PATHS:
            return await handler(request)
        if state.draining:
            return fail(SHUTDOWN_MESSAGE, 503, None, "server_shutting_down")
        state.track(+1)
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except BadRequest as exc:
            resp = fail(exc.message, exc.status, exc.param, exc.code)
            if exc.status == 413:  # do not read (and discard) the rest of a huge body
                resp.force_close()
            return resp
        except (ConfigError, EngineError) as exc:
            unavailable = isinstance(exc, EngineUnavailableError)
            return fail(str(exc), 503 if unavailable else 400)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:  # pragma: no cover - a server bug; say so instead of hanging
            logging.getLogger(__name__).exception("palaestra serve: %s failed", request.path)
            if id(request) in state.streaming:
                raise  # the stream's headers are sent: a second response would corrupt it
            return fail(f"internal error: {type(exc).__name__}: {exc}", 500)
        finally:
            state.track(-1)
            state.streaming.discard(id(request))

    async def close_pool(app: web.Application) -> None:
        state.close_pool()

    # bodies are read by `read_json` with each route's limit; aiohttp's own limit is the largest
    biggest = max(state.options.body_limit("/update_weights_from_tensor"),
                  state.options.body_limit("/generate"))
    app = web.Application(middlewares=[guard], client_max_size=biggest)
    app.on_cleanup.append(close_pool)
    add_generation_routes(app.router, state)
    add_weight_routes(app.router, state)
    add_control_routes(app.router, state)
    openai_api.add_routes(app, state)
    app.router.add_post("/v1/completions", completions_api.handler(state))
    return app


__all__ = ["build_app"]

"""The aiohttp application: routes, the API key check, and errors as JSON 4xx answers.

Every route the server does not serve answers 404 naming the method and path (the SDK fails at
once on a 404, where a 5xx would make it retry for minutes). With ``--api-key`` every request
but ``/api/v1/healthz`` must carry it in ``X-API-Key`` (the SDK's header).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web

from palaestra.tinker_api import (
    routes_sampling,
    routes_service,
    routes_training,
    routes_weights,
)
from palaestra.tinker_api.errors import ApiError
from palaestra.tinker_api.web_io import SERVER_KEY, error_response

if TYPE_CHECKING:
    from palaestra.tinker_api.server import TinkerServer

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """`ApiError` and unknown routes as JSON; the API key check."""
    server = request.app[SERVER_KEY]
    key = server.config.api_key
    if key and request.path != "/api/v1/healthz" and request.headers.get("X-API-Key") != key:
        return error_response("missing or wrong API key (X-API-Key)", 401)
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc.message, exc.status)
    except web.HTTPNotFound:
        return error_response(f"palaestra tinker-server does not serve {request.method} "
                              f"{request.path}", 404)
    except web.HTTPMethodNotAllowed:
        return error_response(f"palaestra tinker-server does not serve {request.method} "
                              f"{request.path}", 404)


def build_app(server: TinkerServer) -> web.Application:
    app = web.Application(middlewares=[errors_middleware], client_max_size=1 << 30)
    app[SERVER_KEY] = server
    routes_service.add_routes(app)
    routes_training.add_routes(app)
    routes_weights.add_routes(app)
    routes_sampling.add_routes(app)
    return app


__all__ = ["build_app"]

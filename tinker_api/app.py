"""The aiohttp application: routes, the API key check, and errors as JSON 4xx answers.

Every route the server does not serve answers 404 naming the method and path (the SDK fails at
once on a 404, where a 5xx would make it retry for minutes). With ``--api-key`` every request
but ``/api/v1/healthz`` must carry it in ``X-API-Key`` (the SDK's header).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from palaestra.tinker_api.errors import ApiError

if TYPE_CHECKING:
    from palaestra.tinker_api.server import TinkerServer

M = TypeVar("M", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SERVER_KEY: web.AppKey[TinkerServer] = web.AppKey("tinker_server")


def error_response(message: str, status: int) -> web.Response:
    return web.json_response({"error": message, "detail": message}, status=status)


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


async def read_json(request: web.Request) -> Mapping[str, object]:
    """The request's JSON object (400 when it is not one)."""
    try:
        payload = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(f"{request.path}: the body is not JSON ({exc})") from exc
    if not isinstance(payload, dict):
        raise ApiError(f"{request.path}: the body must be a JSON object")
    return payload


async def read_model(request: web.Request, cls: type[M]) -> M:
    """The body checked by the SDK's pydantic request type (400 with its complaints)."""
    payload = await read_json(request)
    try:
        return cls.model_validate(payload)
    except ValidationError as exc:
        raise ApiError(f"{request.path}: bad {cls.__name__}: "
                       f"{exc.errors(include_url=False)}") from exc


def answer(model: BaseModel | Mapping[str, object]) -> web.Response:
    """A JSON answer from an SDK response type (or a plain mapping)."""
    body = model.model_dump(mode="json") if isinstance(model, BaseModel) else dict(model)
    return web.json_response(body)


def build_app(server: TinkerServer) -> web.Application:
    from palaestra.tinker_api import (
        routes_sampling,
        routes_service,
        routes_training,
        routes_weights,
    )

    app = web.Application(middlewares=[errors_middleware], client_max_size=1 << 30)
    app[SERVER_KEY] = server
    routes_service.add_routes(app)
    routes_training.add_routes(app)
    routes_weights.add_routes(app)
    routes_sampling.add_routes(app)
    return app


__all__ = ["SERVER_KEY", "answer", "build_app", "error_response", "read_json", "read_model"]

"""Reading requests and writing answers: the server's app key, the SDK's pydantic request types
checked on the way in (400 with pydantic's complaints), its response types dumped on the way out.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from palaestra.tinker_api.errors import ApiError

if TYPE_CHECKING:
    from palaestra.tinker_api.server import TinkerServer

M = TypeVar("M", bound=BaseModel)
SERVER_KEY: web.AppKey[TinkerServer] = web.AppKey("tinker_server")


def error_response(message: str, status: int) -> web.Response:
    return web.json_response({"error": message, "detail": message}, status=status)


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


__all__ = ["SERVER_KEY", "answer", "error_response", "read_json", "read_model"]

"""The gateway's HTTP server (aiohttp): OpenAI routes per session, sessions, and the buffer.

Routes (``{sid}`` is a session id; the plain ``/v1/...`` routes read it from the
``X-Palaestra-Session`` header instead):

- ``POST /sessions/{sid}/v1/chat/completions``, ``POST /v1/chat/completions``: OpenAI chat
  completions (tools, ``stream: true`` as SSE, ``logprobs``); see `Gateway`.
- ``GET /sessions/{sid}/v1/models``, ``GET /v1/models``: the served model.
- ``POST /sessions`` (``{"session_id"?, "max_calls"?, "call_timeout_s"?, "metadata"?}``) ->
  ``{"session_id", "base_url"}``; ``GET /sessions/{sid}``: counters and samples;
  ``DELETE /sessions/{sid}``: free it; ``POST /sessions/{sid}/finish`` (``{"reward",
  "group_id", "group_size"?, "task_id"?}``): turn its samples into a trajectory in the buffer.
- ``POST /trajectories``: finished trajectories from external generators (validated strictly, see
  `palaestra.rollout.gateway.validation`); ``POST /trajectories/claim`` (``{"group_id"}``): hand
  one trajectory of a complete group to a rollout worker in another process; ``POST
  /trajectories/take`` (``{"max_groups"?}``): complete groups for a trainer in another process;
  ``GET /trajectories``: buffer counters.
- ``GET /health``: 200 while an engine behind the gateway is healthy, 503 when none is (the
  state of each engine in the body); always 200 for a buffer-only server.

Every body is parsed strictly (`palaestra.rollout.gateway.bodies`,
`palaestra.rollout.gateway.validation`): all problems of a request come back at once, in
``error.problems``. Errors are OpenAI error bodies ``{"error": {"message", "type", "code"}}``
with a 4xx/5xx status; a body over ``max_body_mb`` is a 413. With `GatewayKeys` every route but
``/health`` needs ``Authorization: Bearer <key>`` (see `palaestra.rollout.gateway.auth`).
`serve_gateway` starts the server inside a running loop on TCP and, optionally, a Unix socket (the
code sandbox blocks every inet socket, loopback included; see `palaestra.rollout.gateway.command`).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from palaestra.errors import ConfigError, TrajectoryValidationError
from palaestra.rollout.gateway.auth import GatewayKeys
from palaestra.rollout.gateway.bodies import parse_claim, parse_finish, parse_session, parse_take
from palaestra.rollout.gateway.checks import RequestValidationError
from palaestra.rollout.gateway.gateway import Gateway
from palaestra.rollout.gateway.responses import completion_json, stream_completion
from palaestra.rollout.gateway.session import STOP_REASONS, GatewayError
from palaestra.rollout.gateway.validation import PostLimits
from palaestra.rollout.gateway.wire import trajectory_to_wire, wire_groups
from palaestra.types import StopReason

if TYPE_CHECKING:
    from aiohttp import web

    from palaestra.engine import TokenGenerator
    from palaestra.rollout.gateway.buffer import TrajectoryBuffer

SESSION_HEADER = "X-Palaestra-Session"
MAX_BODY_MB = 64
HEALTH_TIMEOUT_S = 5.0


def error_response(message: str, status: int = 400, code: str | int | None = None,
                   problems: tuple[str, ...] | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI error body (``problems``: every problem of a refused request, when several)."""
    from aiohttp import web

    kind = "invalid_request_error" if status < 500 else "server_error"
    error: dict[str, Any] = {"message": message, "type": kind, "param": None,
                             "code": code or status}
    if problems:
        error["problems"] = list(problems)
    return web.json_response({"error": error}, status=status, headers=headers)


def _errors(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
            ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Turn gateway and validation errors into OpenAI-style error responses."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        from aiohttp import web

        try:
            return await handler(request)
        except GatewayError as exc:
            return error_response(exc.message, exc.status, exc.code)
        except RequestValidationError as exc:
            return error_response(exc.message, 400, "invalid_request", exc.problems)
        except TrajectoryValidationError as exc:
            status = getattr(exc, "status", 422)
            return error_response(str(exc), status, "invalid_trajectory",
                                  getattr(exc, "problems", None))
        except web.HTTPRequestEntityTooLarge as exc:
            return error_response(
                f"the body is larger than this server takes ({exc.text or 'body limit'}); "
                "raise --max-body-mb or send less per request", 413, "body_too_large")
        except web.HTTPException:
            raise
        except (ConfigError, ValueError, TypeError) as exc:  # a check this module missed
            return error_response(f"invalid request: {exc}", 400)

    return wrapped


async def _json_body(request: web.Request) -> Any:
    raw = await request.read()
    if not raw:
        return {}
    try:
        if len(raw) > OFF_LOOP_BYTES:  # a big post would hold every other request up
            return await asyncio.to_thread(json.loads, raw)
        return json.loads(raw)
    except ValueError as exc:
        raise GatewayError(f"the body is not valid JSON: {exc}") from None


OFF_LOOP_BYTES = 1 << 20


def _auth_middleware(keys: GatewayKeys) -> Any:
    from aiohttp import web

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method == "OPTIONS" or keys.allows(request.path,
                                                      request.headers.get("Authorization")):
            return await handler(request)
        admin = keys.required(request.path) == keys.admin_api_key and keys.admin_api_key
        what = "the admin API key (--admin-api-key)" if admin else "the API key (--api-key)"
        return error_response(
            f"missing or wrong API key: send 'Authorization: Bearer <key>' with {what}", 401,
            "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return auth


async def engine_health(engine: TokenGenerator, timeout_s: float = HEALTH_TIMEOUT_S
                        ) -> tuple[bool, list[dict[str, Any]]]:
    """Whether any engine behind the gateway is healthy, and the state of each."""
    try:
        health = getattr(engine, "health", None)  # a worker's gate over its engine has none
        ok = health is not None and bool(await asyncio.wait_for(health(), timeout_s))
    except Exception:  # noqa: BLE001 - a health probe that fails or times out is a no
        ok = False
    from palaestra.engines.clients.router import Router

    if isinstance(engine, Router):  # one entry per engine
        members = engine.status()
        return ok and any(m["healthy"] for m in members), members
    return ok, [{"name": str(getattr(engine, "url", type(engine).__name__)), "healthy": ok}]


def build_app(gateway: Gateway | None, buffer: TrajectoryBuffer | None = None, *,
              keys: GatewayKeys | None = None, max_body_mb: float = MAX_BODY_MB,
              health_timeout_s: float = HEALTH_TIMEOUT_S) -> web.Application:
    """The aiohttp application of a gateway and/or a trajectory buffer.

    ``keys``: API keys (see `palaestra.rollout.gateway.auth`); ``max_body_mb``: the largest
    request body (413 above it); ``/health`` answers 503 when no engine is healthy.
    """
    from aiohttp import web

    if gateway is None and buffer is None:
        raise ValueError("serve a gateway, a trajectory buffer or both")
    if not max_body_mb > 0:
        raise ConfigError(f"max_body_mb must be positive, got {max_body_mb}")
    middlewares = [_auth_middleware(keys)] if keys is not None else []
    app = web.Application(client_max_size=int(max_body_mb * (1 << 20)), middlewares=middlewares)

    gw: Gateway = gateway  # type: ignore[assignment]  # only used by gateway routes
    meta_cap = buffer.max_metadata_bytes if buffer is not None else PostLimits.max_metadata_bytes
    group_cap = buffer.max_group_size if buffer is not None else PostLimits.max_group_size

    def sid_of(request: web.Request) -> str | None:
        return request.match_info.get("sid") or request.headers.get(SESSION_HEADER)

    def need_buffer() -> TrajectoryBuffer:
        if buffer is None:
            raise GatewayError("this server has no trajectory buffer", 404)
        return buffer

    async def models(request: web.Request) -> web.Response:
        card = {"id": gw.model_name, "object": "model", "created": 0,
                "owned_by": "palaestra", "max_model_len": gw.max_context}
        return web.json_response({"object": "list", "data": [card]})

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        session = gw.session(sid_of(request))
        if not isinstance(body, dict):
            raise GatewayError("the request body must be a JSON object")
        done = await gw.complete(session, body)
        model = body.get("model") or gw.model_name
        if body.get("stream"):
            return await stream_completion(request, done, model, body)
        return web.json_response(completion_json(done, model, body, gw))

    async def create_session(request: web.Request) -> web.Response:
        req = parse_session(await _json_body(request), max_metadata_bytes=meta_cap)
        session = gw.open_session(req.session_id, max_calls=req.max_calls,
                                  call_timeout_s=req.call_timeout_s, metadata=req.metadata)
        base = f"{request.scheme}://{request.host}/sessions/{session.id}/v1"
        return web.json_response({"session_id": session.id, "base_url": base})

    async def get_session(request: web.Request) -> web.Response:
        return web.json_response(gw.session(request.match_info["sid"]).summary())

    async def delete_session(request: web.Request) -> web.Response:
        return web.json_response(gw.close_session(request.match_info["sid"]).summary())

    async def finish_session(request: web.Request) -> web.Response:
        store = need_buffer()
        req = parse_finish(await _json_body(request), max_group_size=group_cap)
        session = gw.session(request.match_info["sid"])
        # a session a limit stopped (context, calls, samples) is a truncated episode, not a
        # terminated one; the reason is read before closing sets "closed"
        stop = STOP_REASONS.get(session.stop_reason or "", StopReason.TERMINATED)
        if not any(ledger.calls for ledger in session.samples):
            raise GatewayError("the session has no completed call to train on", 422)
        gw.close_session(session.id)
        samples = session.to_samples(reward=req.reward, stop_reason=stop, env_id=req.env_id,
                                     task_id=req.task_id, group_id=req.group_id)
        from palaestra.types import Trajectory

        traj = Trajectory(env_id=req.env_id, task_id=req.task_id, messages=session.messages(),
                          turns=session.turns(req.reward), samples=samples, reward=req.reward,
                          stop_reason=stop, metrics=session.metrics(), group_id=req.group_id,
                          error=session.stop_detail or None if stop != StopReason.TERMINATED
                          else None)
        info = store.add_trajectories(req.group_id, [traj], req.group_size)
        return web.json_response({**info, "stop_reason": stop.value})

    async def post_trajectories(request: web.Request) -> web.Response:
        store = need_buffer()
        body = await _json_body(request)
        try:  # validation is pure: off the loop, so that a big post holds nothing up
            parsed = await asyncio.to_thread(store.parse, body)
        except Exception:
            store.reject()
            raise
        return web.json_response(store.store(*parsed))

    async def claim(request: web.Request) -> web.Response:
        store = need_buffer()
        gid = parse_claim(await _json_body(request))
        return web.json_response(trajectory_to_wire(store.claim(gid)))

    async def take(request: web.Request) -> web.Response:
        store = need_buffer()
        limit = parse_take(await _json_body(request))
        return web.json_response({"groups": wire_groups(store.take(limit))})

    async def buffer_stats(request: web.Request) -> web.Response:
        return web.json_response(need_buffer().stats())

    async def health(request: web.Request) -> web.Response:
        if gateway is None:
            return web.json_response({"ok": True})
        ok, engines = await engine_health(gateway.engine, health_timeout_s)
        body = {"ok": ok, "engines": engines, "sessions": len(gateway.sessions),
                "totals": gateway.totals}
        if not ok:
            body["error"] = "no engine behind the gateway is healthy"
        return web.json_response(body, status=200 if ok else 503)

    if gateway is not None:
        for prefix in ("", "/sessions/{sid}"):
            app.router.add_get(f"{prefix}/v1/models", _errors(models))
            app.router.add_post(f"{prefix}/v1/chat/completions", _errors(chat))
        app.router.add_post("/sessions", _errors(create_session))
        app.router.add_get("/sessions/{sid}", _errors(get_session))
        app.router.add_delete("/sessions/{sid}", _errors(delete_session))
        app.router.add_post("/sessions/{sid}/finish", _errors(finish_session))
    app.router.add_post("/trajectories", _errors(post_trajectories))
    app.router.add_post("/trajectories/claim", _errors(claim))
    app.router.add_post("/trajectories/take", _errors(take))
    app.router.add_get("/trajectories", _errors(buffer_stats))
    app.router.add_get("/health", _errors(health))
    return app


@dataclass
class RunningGateway:
    """A gateway server started by `serve_gateway`; ``await close()`` stops the server."""

    gateway: Gateway | None
    url: str
    unix_path: str | None
    runner: web.AppRunner

    def base_url(self, session_id: str) -> str:
        """The OpenAI base URL of one session (what ``OPENAI_BASE_URL`` is set to)."""
        return f"{self.url}/sessions/{session_id}/v1"

    async def close(self) -> None:
        await self.runner.cleanup()
        if self.unix_path and os.path.exists(self.unix_path):
            os.unlink(self.unix_path)


async def serve_gateway(
    gateway: Gateway | None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    unix_path: str | None = None,
    buffer: TrajectoryBuffer | None = None,
    keys: GatewayKeys | None = None,
    max_body_mb: float = MAX_BODY_MB,
    health_timeout_s: float = HEALTH_TIMEOUT_S,
) -> RunningGateway:
    """Serve ``gateway`` (and/or ``buffer``) on ``host:port`` (0 = a free port) and, if given, a
    Unix socket. ``serve_gateway(None, buffer=buffer)`` is a plain rollout buffer server.
    ``keys``, ``max_body_mb`` and ``health_timeout_s``: see `build_app`."""
    from aiohttp import web

    app = build_app(gateway, buffer, keys=keys, max_body_mb=max_body_mb,
                    health_timeout_s=health_timeout_s)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server  # aiohttp keeps the bound sockets there
    sockets = getattr(server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    if unix_path is not None:
        if os.path.exists(unix_path):
            os.unlink(unix_path)
        await web.UnixSite(runner, unix_path).start()
        os.chmod(unix_path, 0o777)  # sandboxed runs have their own uid
    return RunningGateway(gateway, f"http://{host}:{bound}", unix_path, runner)


__all__ = [
    "HEALTH_TIMEOUT_S",
    "MAX_BODY_MB",
    "SESSION_HEADER",
    "RunningGateway",
    "build_app",
    "engine_health",
    "error_response",
    "serve_gateway",
]

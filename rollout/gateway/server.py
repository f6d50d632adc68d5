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
- ``GET /health``.

Errors are OpenAI error bodies ``{"error": {"message", "type", "code"}}`` with a 4xx/5xx status.
`serve_gateway` starts the server inside a running loop on TCP and, optionally, a Unix socket (the
code sandbox blocks every inet socket, loopback included; see `palaestra.rollout.gateway.command`).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from palaestra.errors import TrajectoryValidationError
from palaestra.rollout.gateway.gateway import Completion, Gateway
from palaestra.rollout.gateway.session import GatewayError
from palaestra.types import StopReason

if TYPE_CHECKING:
    from aiohttp import web

    from palaestra.rollout.gateway.buffer import TrajectoryBuffer

SESSION_HEADER = "X-Palaestra-Session"
MAX_BODY_BYTES = 256 << 20


def error_response(message: str, status: int = 400, code: str | None = None) -> web.Response:
    from aiohttp import web

    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": code or status}}
    return web.json_response(body, status=status)


def _errors(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
            ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Turn gateway and validation errors into OpenAI-style error responses."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        from aiohttp import web

        try:
            return await handler(request)
        except GatewayError as exc:
            return error_response(exc.message, exc.status, exc.code)
        except TrajectoryValidationError as exc:
            status = getattr(exc, "status", 422)
            return error_response(str(exc), status, "invalid_trajectory")
        except web.HTTPException:
            raise
        except (ValueError, TypeError) as exc:
            return error_response(f"{type(exc).__name__}: {exc}", 400)

    return wrapped


async def _json_body(request: web.Request) -> Any:
    raw = await request.read()
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise GatewayError(f"the body is not valid JSON: {exc}") from None


def build_app(gateway: Gateway | None, buffer: TrajectoryBuffer | None = None
              ) -> web.Application:
    """The aiohttp application of a gateway and/or a trajectory buffer."""
    from aiohttp import web

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    if gateway is None and buffer is None:
        raise ValueError("serve a gateway, a trajectory buffer or both")

    gw: Gateway = gateway  # type: ignore[assignment]  # only used by gateway routes

    def sid_of(request: web.Request) -> str | None:
        return request.match_info.get("sid") or request.headers.get(SESSION_HEADER)

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
            return await _stream(request, done, model, body)
        return web.json_response(_completion_json(done, model, body, gw))

    async def create_session(request: web.Request) -> web.Response:
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise GatewayError("the body must be a JSON object")
        session = gw.open_session(
            body.get("session_id"), max_calls=body.get("max_calls"),
            call_timeout_s=body.get("call_timeout_s"), metadata=body.get("metadata"))
        base = f"{request.scheme}://{request.host}/sessions/{session.id}/v1"
        return web.json_response({"session_id": session.id, "base_url": base})

    async def get_session(request: web.Request) -> web.Response:
        return web.json_response(gw.session(request.match_info["sid"]).summary())

    async def delete_session(request: web.Request) -> web.Response:
        return web.json_response(gw.close_session(request.match_info["sid"]).summary())

    async def finish_session(request: web.Request) -> web.Response:
        if buffer is None:
            raise GatewayError("this gateway has no trajectory buffer", 404)
        body = await _json_body(request)
        if not isinstance(body, dict) or "reward" not in body or "group_id" not in body:
            raise GatewayError("finish needs {'reward': float, 'group_id': str}")
        session = gw.session(request.match_info["sid"])
        from palaestra.rollout.gateway.validation import finite_number

        reward = finite_number(body["reward"], "reward")
        gw.close_session(session.id)
        samples = session.to_samples(reward=reward, stop_reason=StopReason.TERMINATED,
                                     task_id=str(body.get("task_id", "")),
                                     group_id=str(body["group_id"]))
        if not samples:
            raise GatewayError("the session has no completed call to train on", 422)
        from palaestra.types import Trajectory

        traj = Trajectory(env_id=str(body.get("env_id", "gateway")),
                          task_id=str(body.get("task_id", "")), messages=session.messages(),
                          turns=session.turns(reward), samples=samples, reward=reward,
                          stop_reason=StopReason.TERMINATED, metrics=session.metrics(),
                          group_id=str(body["group_id"]))
        info = buffer.add_trajectories(str(body["group_id"]), [traj], body.get("group_size"))
        return web.json_response(info)

    async def post_trajectories(request: web.Request) -> web.Response:
        if buffer is None:
            raise GatewayError("this server has no trajectory buffer", 404)
        body = await _json_body(request)
        return web.json_response(buffer.add(body))

    async def claim(request: web.Request) -> web.Response:
        if buffer is None:
            raise GatewayError("this server has no trajectory buffer", 404)
        body = await _json_body(request)
        gid = body.get("group_id") if isinstance(body, dict) else None
        if not gid:
            raise GatewayError("claim needs {'group_id': ...}")
        traj = buffer.claim(str(gid))
        from palaestra.rollout.gateway.validation import trajectory_to_wire

        return web.json_response(trajectory_to_wire(traj))

    async def take(request: web.Request) -> web.Response:
        if buffer is None:
            raise GatewayError("this server has no trajectory buffer", 404)
        body = await _json_body(request)
        limit = body.get("max_groups") if isinstance(body, dict) else None
        from palaestra.rollout.gateway.validation import trajectory_to_wire

        groups = buffer.take(int(limit) if limit is not None else None)
        return web.json_response({"groups": [
            {"group_id": g.group_id, "trajectories": [trajectory_to_wire(t) for t in g.trajectories]}
            for g in groups]})

    async def buffer_stats(request: web.Request) -> web.Response:
        if buffer is None:
            raise GatewayError("this server has no trajectory buffer", 404)
        return web.json_response(buffer.stats())

    async def health(request: web.Request) -> web.Response:
        if gateway is None:
            return web.json_response({"ok": True})
        return web.json_response({"ok": True, "sessions": len(gateway.sessions),
                                  "totals": gateway.totals})

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


def _completion_json(done: Completion, model: str, body: dict[str, Any],
                     gateway: Gateway) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "message": done.message, "logprobs": None,
                              "finish_reason": done.finish_reason}
    if body.get("logprobs"):
        decode = gateway.chat.decode
        choice["logprobs"] = {"content": [
            {"token": decode([t]), "logprob": lp, "bytes": list(decode([t]).encode()),
             "top_logprobs": []}
            for t, lp in zip(done.token_ids, done.logprobs)]}
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
        "created": int(time.time()), "model": model, "choices": [choice],
        "usage": _usage(done),
        "palaestra": {"sample": done.sample_index, "continued": done.continued},
    }


def _usage(done: Completion) -> dict[str, Any]:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


async def _stream(request: web.Request, done: Completion, model: str,
                  body: dict[str, Any]) -> web.StreamResponse:
    """The finished completion as OpenAI SSE chunks (role, content, tool calls, finish)."""
    from aiohttp import web

    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    async def send(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> None:
        chunk: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk",
                                 "created": created, "model": model, "choices": choices}
        if usage is not None:
            chunk["usage"] = usage
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

    def choice(delta: dict[str, Any], finish: str | None = None) -> list[dict[str, Any]]:
        return [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]

    message = done.message
    await send(choice({"role": "assistant", "content": ""}))
    if message.get("reasoning_content"):
        await send(choice({"reasoning_content": message["reasoning_content"]}))
    if message.get("content"):
        await send(choice({"content": message["content"]}))
    for i, call in enumerate(message.get("tool_calls") or ()):
        await send(choice({"tool_calls": [{"index": i, **call}]}))
    await send(choice({}, done.finish_reason))
    if (body.get("stream_options") or {}).get("include_usage"):
        await send([], _usage(done))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


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
) -> RunningGateway:
    """Serve ``gateway`` (and/or ``buffer``) on ``host:port`` (0 = a free port) and, if given, a
    Unix socket. ``serve_gateway(None, buffer=buffer)`` is a plain rollout buffer server."""
    from aiohttp import web

    runner = web.AppRunner(build_app(gateway, buffer), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server  # aiohttp keeps the bound sockets there
    sockets = server.sockets if server is not None else []  # type: ignore[union-attr]
    bound = sockets[0].getsockname()[1] if sockets else port
    if unix_path is not None:
        if os.path.exists(unix_path):
            os.unlink(unix_path)
        await web.UnixSite(runner, unix_path).start()
        os.chmod(unix_path, 0o777)  # sandboxed runs have their own uid
    return RunningGateway(gateway, f"http://{host}:{bound}", unix_path, runner)


__all__ = ["SESSION_HEADER", "RunningGateway", "build_app", "error_response", "serve_gateway"]

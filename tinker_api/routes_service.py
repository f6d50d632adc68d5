"""Service routes: health, capabilities, client config, sessions, futures, runs and checkpoints.

The client config turns off what this server does not do (JWT exchange, the pyqwest
transport, zstd bodies, server-side custom losses, the session-wide futures poller), so the SDK
uses plain API keys, httpx, one ``retrieve_future`` per result and client-side custom losses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from palaestra.tinker_api.errors import ApiError, not_found
from palaestra.tinker_api.futures import Failure
from palaestra.tinker_api.registry import Checkpoint, TrainingModel
from palaestra.tinker_api.web_io import SERVER_KEY, answer, read_json, read_model
from palaestra.tinker_api.wire import PROTO_CONTENT_TYPE

if TYPE_CHECKING:
    from palaestra.tinker_api.server import TinkerServer


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def capabilities(request: web.Request) -> web.Response:
    from tinker.types import GetServerCapabilitiesResponse, SupportedModel

    server = request.app[SERVER_KEY]
    models = [SupportedModel(model_name=name, max_context_length=server.limits.max_context,
                             trainable=True, sampleable=True) for name in server.config.names]
    return answer(GetServerCapabilitiesResponse(supported_models=models))


async def client_config(request: web.Request) -> web.Response:
    from tinker.types import ClientConfigResponse

    return answer(ClientConfigResponse(
        pjwt_auth_enabled=False, use_pyqwest_transport=False, proto_compress_fwdbwd=False,
        parallel_fwdbwd_chunks=False, custom_loss_server_side=False,
        sample_use_retrieve_futures=False, sample_join_sampling_session=False))


async def dynamic_config(request: web.Request) -> web.Response:
    from tinker.types import ClientDynamicConfigResponse

    return answer(ClientDynamicConfigResponse(refresh_interval_sec=3600))


async def create_session(request: web.Request) -> web.Response:
    from tinker.types import CreateSessionRequest, CreateSessionResponse

    await read_model(request, CreateSessionRequest)
    session = request.app[SERVER_KEY].registry.new_session()
    return answer(CreateSessionResponse(session_id=session.session_id))


async def heartbeat(request: web.Request) -> web.Response:
    import time

    from tinker.types import SessionHeartbeatRequest, SessionHeartbeatResponse

    req = await read_model(request, SessionHeartbeatRequest)
    request.app[SERVER_KEY].registry.session(req.session_id).last_heartbeat = time.time()
    return answer(SessionHeartbeatResponse())


async def finish_session(request: web.Request) -> web.Response:
    """Mark a session finished (the first reason wins; finishing again is a no-op) and free its
    training clients' adapters and its snapshot samplers; records and checkpoints stay."""
    payload = await read_json(request)
    session_id = request.match_info["session_id"]
    server = request.app[SERVER_KEY]
    session = server.registry.sessions.get(session_id)
    if session is None:
        raise not_found("session", session_id)
    if session.finished is None:
        reason = payload.get("reason")
        session.finished = str(reason.get("type") if isinstance(reason, dict) else "finished")
        await release_session(server, session_id)
    return web.json_response({})


async def release_session(server: TinkerServer, session_id: str) -> None:
    """Free what a finished session holds in the trainer and the engine."""
    for model in [m for m in server.registry.models.values()
                  if m.session_id == session_id and not m.released]:
        model.released = True
        await server.compute(server.trainer.remove, model.model_id)
    snapshots = [(s.sampler_id, s.adapter) for s in server.registry.samplers.values()
                 if s.sampler_id.startswith(f"{session_id}:") and s.model_path is None]
    for sampler_id, adapter in snapshots:
        if adapter is not None and await server.sampler.unload(adapter):
            server.registry.samplers.pop(sampler_id, None)


async def telemetry(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"status": "accepted"})


async def cancel_future(request: web.Request) -> web.Response:
    await read_json(request)  # a sample already running finishes; its result is dropped later
    return web.json_response({})


async def retrieve_future(request: web.Request) -> web.Response:
    from tinker.types import FutureRetrieveRequest

    req = await read_model(request, FutureRetrieveRequest)
    server = request.app[SERVER_KEY]
    outcome = await server.futures.retrieve(req.request_id, server.config.poll_timeout_s)
    if outcome is None:
        return web.json_response({"type": "try_again", "request_id": req.request_id,
                                  "queue_state": "active"})
    if isinstance(outcome, Failure):
        return web.json_response(outcome.as_json())
    if outcome.proto is not None:
        return web.Response(body=outcome.proto, content_type=PROTO_CONTENT_TYPE)
    return web.json_response(dict(outcome.json or {}))


def _checkpoint_json(ckpt: Checkpoint) -> dict[str, object]:
    size = sum(f.stat().st_size for f in ckpt.directory.glob("*") if f.is_file())
    return {"checkpoint_id": ckpt.checkpoint_id, "tinker_path": ckpt.path,
            "checkpoint_type": ckpt.kind, "time": ckpt.created.isoformat(), "size_bytes": size,
            "public": False, "user_metadata": ckpt.user_metadata}


def _run_json(model: TrainingModel) -> dict[str, object]:
    by_kind: dict[str, dict[str, object] | None] = {"training": None, "sampler": None}
    for ckpt in model.checkpoints.values():
        by_kind[ckpt.kind] = _checkpoint_json(ckpt)
    return {"training_run_id": model.model_id, "base_model": model.base_model,
            "model_owner": model.session_id, "is_lora": True, "lora_rank": model.spec.rank,
            "last_request_time": model.last_request.isoformat(),
            "last_checkpoint": by_kind["training"],
            "last_sampler_checkpoint": by_kind["sampler"], "user_metadata": model.user_metadata}


async def list_checkpoints(request: web.Request) -> web.Response:
    model = request.app[SERVER_KEY].registry.model(request.match_info["model_id"], live=False)
    return web.json_response({"checkpoints": [_checkpoint_json(c)
                                              for c in model.checkpoints.values()]})


async def training_run(request: web.Request) -> web.Response:
    model = request.app[SERVER_KEY].registry.model(request.match_info["model_id"], live=False)
    return web.json_response(_run_json(model))


async def training_runs(request: web.Request) -> web.Response:
    models = list(request.app[SERVER_KEY].registry.models.values())
    try:
        limit = int(request.query.get("limit", "20"))
        offset = int(request.query.get("offset", "0"))
    except ValueError as exc:
        raise ApiError(f"limit and offset must be integers ({exc})") from exc
    page = models[offset:offset + limit]
    return web.json_response({"training_runs": [_run_json(m) for m in page],
                              "cursor": {"offset": offset, "limit": limit,
                                         "total_count": len(models)}})


async def weights_info(request: web.Request) -> web.Response:
    payload = await read_json(request)
    server = request.app[SERVER_KEY]
    ckpt = server.registry.checkpoint(str(payload.get("tinker_path", "")))
    from palaestra.tinker_api.trainer import read_spec

    spec = read_spec(ckpt.directory)
    model = server.registry.models.get(ckpt.model_id)
    return web.json_response({
        "base_model": model.base_model if model else server.config.names[0], "is_lora": True,
        "lora_rank": spec.rank, "train_unembed": spec.train_unembed, "train_mlp": spec.train_mlp,
        "train_attn": spec.train_attn})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/api/v1/healthz", healthz)
    app.router.add_get("/api/v1/get_server_capabilities", capabilities)
    app.router.add_post("/api/v1/client/config", client_config)
    app.router.add_post("/api/v1/client/dynamic_config", dynamic_config)
    app.router.add_post("/api/v1/create_session", create_session)
    app.router.add_post("/api/v1/session_heartbeat", heartbeat)
    app.router.add_post("/api/v1/sessions/{session_id}/finish", finish_session)
    app.router.add_post("/api/v1/telemetry", telemetry)
    app.router.add_post("/api/v1/cancel_future", cancel_future)
    app.router.add_post("/api/v1/retrieve_future", retrieve_future)
    app.router.add_get("/api/v1/training_runs", training_runs)
    app.router.add_get("/api/v1/training_runs/{model_id}", training_run)
    app.router.add_get("/api/v1/training_runs/{model_id}/checkpoints", list_checkpoints)
    app.router.add_post("/api/v1/weights_info", weights_info)


__all__ = ["add_routes"]

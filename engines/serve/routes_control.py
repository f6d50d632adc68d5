"""SGLang's control routes of `palaestra serve`: pause and continue generation, abort
requests, flush the prefix cache, release and resume the engine's GPU memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from palaestra.engines.serve import sglang_protocol as sp
from palaestra.engines.serve.server_state import (
    ServerState,
    read_json,
)

if TYPE_CHECKING:
    from aiohttp import web


def add_control_routes(r: web.UrlDispatcher, state: ServerState) -> None:
    """Pause, continue, abort, flush the cache, release and resume memory."""
    from aiohttp import web

    engine = state.engine

    async def pause(request: web.Request) -> web.Response:
        body = sp.check_body(await read_json(request, state), sp.PAUSE_GENERATION_REQ_INPUT,
                             "PauseGenerationReqInput")
        await engine.pause(body.get("mode", "abort"))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(request: web.Request) -> web.Response:
        sp.check_body(await read_json(request, state), sp.CONTINUE_GENERATION_REQ_INPUT,
                      "ContinueGenerationReqInput")
        await engine.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort(request: web.Request) -> web.Response:
        body = sp.check_body(await read_json(request, state), sp.ABORT_REQ, "AbortReq")
        if body.get("abort_all"):
            await engine.abort(None)
        elif body.get("rid"):
            rid = body["rid"]
            await engine.abort([r for r in engine.request_ids() if r == rid
                                or r.startswith(rid + "_")])
        return web.Response(status=200)

    async def flush(request: web.Request) -> web.Response:
        await engine.flush_cache()
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. "
                            "(When there are running or waiting requests, the operation will "
                            "not be performed.)\n")

    async def release(request: web.Request) -> web.Response:
        body = sp.check_body(await read_json(request, state), sp.RELEASE_MEMORY_OCCUPATION_REQ_INPUT,
                             "ReleaseMemoryOccupationReqInput")
        await engine.release_memory(body.get("tags"))
        return web.json_response(None)

    async def resume_memory(request: web.Request) -> web.Response:
        body = sp.check_body(await read_json(request, state), sp.RESUME_MEMORY_OCCUPATION_REQ_INPUT,
                             "ResumeMemoryOccupationReqInput")
        await engine.resume_memory(body.get("tags"))
        return web.json_response(None)

    r.add_post("/pause_generation", pause)
    r.add_post("/continue_generation", resume)
    r.add_post("/abort_request", abort)
    for method in ("GET", "POST"):
        r.add_route(method, "/flush_cache", flush)
        r.add_route(method, "/release_memory_occupation", release)
        r.add_route(method, "/resume_memory_occupation", resume_memory)


__all__ = ["add_control_routes"]

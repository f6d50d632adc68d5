"""SGLang's weight routes of `palaestra serve`: the weight version, updates from disk, from
tensors (CUDA IPC or base64 safetensors) and from a weight-update group (NCCL or gloo), the
groups, weights by name, and LoRA adapters.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from palaestra.asyncio_utils import in_daemon_thread
from palaestra.errors import ConfigError, EngineError
from palaestra.engines.serve import sglang_protocol as sp
from palaestra.engines.serve.server_state import (
    ServerState,
    read_json,
)
from palaestra.engines.serve.serve_requests import (
    BadRequest,
)

if TYPE_CHECKING:
    from aiohttp import web


def _version_arg(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(
            f"weight_version must be an integer string for palaestra serve, got {value!r}"
        ) from None


def add_weight_routes(r: web.UrlDispatcher, state: ServerState) -> None:
    """The weight routes: version, update from disk / tensors / a weight-update group, the
    groups themselves, weights by name, and LoRA adapters (load, unload)."""
    _add_version_routes(r, state)
    _add_update_routes(r, state)
    _add_group_routes(r, state)
    _add_lora_routes(r, state)


async def _update(state: ServerState, body: dict[str, Any],
                  load: Callable[[int | None], Awaitable[None]]) -> tuple[bool, str, int]:
    """Run ``load`` (after aborting every request when asked): (ok, message, aborted count)."""
    engine = state.engine
    version = _version_arg(body.get("weight_version"))
    paused = 0
    if body.get("abort_all_requests"):
        paused = int(engine.stats["running"] + engine.stats["waiting"])
        await engine.abort(None)
    try:
        await load(version)
    except (EngineError, ConfigError) as exc:
        return False, f"Failed to update weights: {exc}", paused
    state.weight_label = None
    return True, f"Succeeded to update model weights. Weight version {engine.weight_version}.", paused


async def _load_tensors(state: ServerState, body: dict[str, Any], tensors: Any) -> web.Response:
    """Swap received (name, tensor) pairs in between two steps; SGLang's success answer."""
    from aiohttp import web

    async def load(version: int | None) -> None:
        await state.engine.update_weights(tensors, version=version)

    ok, message, _ = await _update(state, body, load)
    return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)


def _add_version_routes(r: web.UrlDispatcher, state: ServerState) -> None:
    """The served weights' version (read, relabel) and the weights by name."""
    from aiohttp import web

    engine = state.engine

    async def weight_version(request: web.Request) -> web.Response:
        return web.json_response({"weight_version": state.weight_version})

    async def update_weight_version(request: web.Request) -> web.Response:
        body = sp.check_body(await read_json(request, state), sp.UPDATE_WEIGHT_VERSION_REQ_INPUT,
                             "UpdateWeightVersionReqInput")
        if body.get("abort_all_requests", True):
            await engine.abort(None)
        new = body["new_version"]
        try:
            engine.set_weight_version(int(new))  # numeric labels are the engine's version
            state.weight_label = None
        except ValueError:
            state.weight_label = new
        return web.json_response({"success": True, "message": f"Weight version updated to {new}",
                                  "new_version": new})

    async def weights_by_name(request: web.Request) -> web.Response:
        raw = await read_json(request, state)
        if raw is None:  # GET with a query string instead of SGLang's JSON body
            raw = {k: int(v) if k == "truncate_size" and v.lstrip("-").isdigit() else v
                   for k, v in request.query.items()}
        body = sp.check_body(raw, sp.GET_WEIGHTS_BY_NAME_REQ_INPUT, "GetWeightsByNameReqInput")
        values = engine.get_weight(body["name"], int(body.get("truncate_size", 100)))
        return web.json_response(values)

    r.add_get("/get_weight_version", weight_version)
    r.add_post("/update_weight_version", update_weight_version)
    r.add_route("GET", "/get_weights_by_name", weights_by_name)
    r.add_post("/get_weights_by_name", weights_by_name)


def _add_update_routes(r: web.UrlDispatcher, state: ServerState) -> None:
    """Weight updates from disk, from tensors in the body, and from a weight-update group."""
    from aiohttp import web

    engine = state.engine

    async def update_from_disk(request: web.Request) -> web.Response:
        body = sp.check_body(await read_json(request, state), sp.UPDATE_WEIGHT_FROM_DISK_REQ_INPUT,
                             "UpdateWeightFromDiskReqInput")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise ConfigError("load_format must be auto or safetensors for palaestra serve")

        async def load(version: int | None) -> None:
            await engine.update_weights(path=body["model_path"], version=version)

        ok, message, paused = await _update(state, body, load)
        if ok:  # /get_model_info and /get_server_info name the weights now served
            state.model_path = body["model_path"]
        return web.json_response({"success": ok, "message": message,
                                  "num_paused_requests": paused}, status=200 if ok else 400)

    async def update_from_tensor(request: web.Request) -> web.Response:
        from palaestra.engines.weights.tensor_payload import decode_payload

        body = sp.check_body(await read_json(request, state), sp.UPDATE_WEIGHTS_FROM_TENSOR_REQ_INPUT,
                             "UpdateWeightsFromTensorReqInput")
        payloads = body["serialized_named_tensors"]
        if not payloads or not all(isinstance(p, str) for p in payloads):
            raise ConfigError("serialized_named_tensors must be a non-empty list of base64 strings")
        if body.get("load_format") not in (None, "safetensors"):
            raise ConfigError(
                f"load_format {body['load_format']!r} is not supported; palaestra serve takes "
                "(name, tensor) pairs: SGLang's IPC pickle or base64 safetensors (load_format "
                "null or 'safetensors')"
            )
        # tp rank 0: this server is one rank. IPC handles map the sender's memory: copied into
        # the engine (and the copies finished) before the answer lets the sender free them
        tensors, shared = decode_payload(payloads[0])
        answer = await _load_tensors(state, body, tensors)
        if shared and engine.device.type == "cuda":
            import torch

            torch.cuda.synchronize(engine.device)
        del tensors
        return answer

    async def update_from_distributed(request: web.Request) -> web.Response:
        from palaestra.engines.weights.weight_group import receive_tensors

        body = sp.check_body(await read_json(request, state), sp.UPDATE_WEIGHTS_FROM_DISTRIBUTED_REQ_INPUT,
                             "UpdateWeightsFromDistributedReqInput")
        if not len(body["names"]) == len(body["dtypes"]) == len(body["shapes"]):
            raise ConfigError("names, dtypes and shapes must have the same length")
        if body.get("load_format") not in (None, "auto"):
            raise ConfigError(f"load_format {body['load_format']!r} is not supported here; "
                              "broadcast tensor by tensor (load_format null)")
        name = body.get("group_name", "weight_update_group")
        if name not in state.weight_groups:
            return web.json_response({"success": False, "message": (
                f"no weight-update group {name!r}: call /init_weights_update_group first")},
                status=400)
        group, device = state.weight_groups[name]
        # receive first (the trainer is broadcasting now), then swap them in between two steps
        try:
            tensors = await asyncio.wait_for(in_daemon_thread(
                receive_tensors, group, body["names"], body["dtypes"], body["shapes"], device),
                state.options.weight_group_timeout_s)
        except asyncio.TimeoutError:
            return web.json_response({"success": False, "message": (
                f"the broadcast of {len(body['names'])} tensors did not complete within "
                f"{state.options.weight_group_timeout_s:g} s; is the trainer broadcasting?")},
                status=400)
        return await _load_tensors(state, body, tensors)

    r.add_post("/update_weights_from_disk", update_from_disk)
    r.add_post("/update_weights_from_tensor", update_from_tensor)
    r.add_post("/update_weights_from_distributed", update_from_distributed)


def _add_group_routes(r: web.UrlDispatcher, state: ServerState) -> None:
    """Create and destroy the weight-update groups (NCCL or gloo) the trainer broadcasts on."""
    from aiohttp import web

    engine = state.engine

    async def init_group(request: web.Request) -> web.Response:
        from palaestra.engines.weights.weight_group import init_weight_group

        body = sp.check_body(await read_json(request, state), sp.INIT_WEIGHTS_UPDATE_GROUP_REQ_INPUT,
                             "InitWeightsUpdateGroupReqInput")
        name = body.get("group_name", "weight_update_group")
        backend = body.get("backend", "nccl")
        if name in state.weight_groups:
            return web.json_response({"success": False, "message": (
                f"weight-update group {name!r} exists; destroy it first")}, status=400)
        if backend == "nccl" and engine.device.type != "cuda":
            return web.json_response({"success": False, "message": (
                f"this server runs on {engine.device}; NCCL needs a CUDA engine: use backend "
                "'gloo', or /update_weights_from_tensor or /update_weights_from_disk")},
                status=400)
        port, world, rank = body["master_port"], body["world_size"], body["rank_offset"]
        if not (0 < port < 65536 and world >= 2 and 0 < rank < world):
            raise BadRequest(f"master_port {port} must be in 1..65535, world_size {world} >= 2 "
                             f"and rank_offset {rank} in 1..world_size-1 (rank 0 is the trainer)")
        opts = state.options
        try:  # blocks until the trainer (rank 0) and every server joined: off the event loop,
            # in a daemon thread so that a rendezvous the trainer abandoned cannot block exit;
            # bounded twice (torch's store timeout, and here) so the caller always gets an answer
            group = await asyncio.wait_for(in_daemon_thread(
                init_weight_group, backend=backend, master_address=body["master_address"],
                master_port=port, world_size=world, rank=rank, group_name=name,
                timeout_s=opts.weight_group_timeout_s,
                connect_timeout_s=opts.weight_group_connect_timeout_s),
                opts.weight_group_timeout_s + opts.weight_group_connect_timeout_s + 5)
        except asyncio.TimeoutError:
            return web.json_response({"success": False, "message": (
                "Failed to initialize custom process group: the rendezvous at "
                f"{body['master_address']}:{port} did not complete within "
                f"{opts.weight_group_timeout_s:g} s (palaestra serve --weight-group-timeout-s)."
            )}, status=400)
        except (RuntimeError, ValueError, OSError) as exc:  # rendezvous failed or timed out
            return web.json_response({"success": False, "message": (
                f"Failed to initialize custom process group: {exc}.")}, status=400)
        state.weight_groups[name] = (group, engine.device if backend == "nccl" else "cpu")
        return web.json_response({"success": True,
                                  "message": "Succeeded to initialize custom process group."})

    async def destroy_group(request: web.Request) -> web.Response:
        from palaestra.engines.weights.weight_group import destroy_weight_group

        body = sp.check_body(await read_json(request, state), sp.DESTROY_WEIGHTS_UPDATE_GROUP_REQ_INPUT,
                             "DestroyWeightsUpdateGroupReqInput")
        entry = state.weight_groups.pop(body.get("group_name", "weight_update_group"), None)
        if entry is None:
            return web.json_response({"success": False, "message": (
                "The group to be destroyed does not exist.")}, status=400)
        await in_daemon_thread(destroy_weight_group, entry[0])
        return web.json_response({"success": True,
                                  "message": "Succeeded to destroy custom process group."})

    r.add_post("/init_weights_update_group", init_group)
    r.add_post("/destroy_weights_update_group", destroy_group)


def _lora_answer(state: ServerState, ok: bool, error: str | None) -> web.Response:
    """SGLang's LoRAUpdateOutput: success, error_message, loaded_adapters (name -> path)."""
    from aiohttp import web

    runtime = state.engine.decoder.lora
    loaded = {n: runtime.adapter(n).source for n in runtime.names} if runtime else {}
    return web.json_response({"success": ok, "error_message": error,
                              "loaded_adapters": loaded}, status=200 if ok else 400)


def _lora_body(body: Any, fields: tuple[str, ...]) -> dict[str, Any]:
    allowed = {*fields, "pinned", "lora_id", "rid"}
    if not isinstance(body, dict) or set(body) - allowed:
        raise ConfigError(f"the body takes {', '.join(sorted(allowed))}; got "
                          f"{sorted(body) if isinstance(body, dict) else type(body).__name__}")
    for key in fields:
        if not isinstance(body.get(key), str) or not body[key]:
            raise ConfigError(f"{key} must be a non-empty string")
    return body


def _add_lora_routes(r: web.UrlDispatcher, state: ServerState) -> None:
    """Load and unload LoRA adapters by name."""
    engine = state.engine

    async def load_lora(request: web.Request) -> web.Response:
        body = _lora_body(await read_json(request, state), ("lora_name", "lora_path"))
        try:
            await engine.load_lora_adapter(body["lora_name"], body["lora_path"])
        except EngineError as exc:
            return _lora_answer(state, False, str(exc))
        return _lora_answer(state, True, None)

    async def unload_lora(request: web.Request) -> web.Response:
        body = _lora_body(await read_json(request, state), ("lora_name",))
        try:
            await engine.unload_lora_adapter(body["lora_name"])
        except EngineError as exc:
            return _lora_answer(state, False, str(exc))
        return _lora_answer(state, True, None)

    r.add_post("/load_lora_adapter", load_lora)
    r.add_post("/unload_lora_adapter", unload_lora)


__all__ = ["add_weight_routes"]

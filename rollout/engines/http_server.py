"""The aiohttp app of `palaestra serve`: SGLang's native HTTP API over a `LocalEngine`.

Endpoints, request bodies and responses follow SGLang's ``http_server.py`` and ``io_struct.py``
(field tables in `sglang_protocol`), so `SGLangEngine` and any SGLang client talk to this server
as to SGLang itself. Differences, all answered with a clear 400: ``/update_weights_from_tensor``
takes base64 safetensors payloads (see `tensor_payload`), weight-update groups (`weight_group`)
take "nccl" on a CUDA engine and also "gloo" (CPU), and multimodal inputs, LoRA, prompt logprobs
and grammars are refused.
The OpenAI-compatible routes live in `openai_api`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from palaestra.asyncio_utils import in_daemon_thread
from palaestra.errors import ConfigError, EngineError
from palaestra.rollout.engines import sglang_protocol as sp
from palaestra.rollout.engines.base import EngineUnavailableError, SamplingParams

if TYPE_CHECKING:
    from aiohttp import web

    from palaestra.rollout.engines.local import LocalEngine

Handler = Callable[["web.Request"], Awaitable["web.StreamResponse"]]

# GenerateReqInput fields we act on, and those we accept only at their default value.
_GENERATE_IGNORED = {
    "log_metrics", "priority", "custom_labels", "no_logs", "routing_key", "conversation_id",
    "extra_key", "cache_salt", "received_time", "external_trace_header", "routed_dp_rank",
    "data_parallel_rank", "http_worker_ipc", "background", "return_bytes", "modalities",
    "return_text_in_logprobs", "return_prompt_token_ids",
}
_GENERATE_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "input_embeds": (None,), "image_data": (None, []), "video_data": (None, []),
    "audio_data": (None, []), "lora_path": (None,), "lora_id": (None,),
    "session_params": (None,), "custom_logit_processor": (None,),
    "return_hidden_states": (False,), "return_routed_experts": (False,),
    "return_indexer_topk": (False,), "top_logprobs_num": (None, 0),
    "token_ids_logprob": (None, []), "return_sampling_mask": (None, False),
    "return_entropy": (False,), "require_reasoning": (False,), "max_thinking_tokens": (None,),
    "return_flat_raw_top_logprobs": (False,), "positional_embed_overrides": (None,),
    "bootstrap_host": (None,), "bootstrap_port": (None,), "bootstrap_room": (None,),
}


@dataclass
class ServerState:
    """What the handlers share: the engine, its tokenizer and the served model's names."""

    engine: LocalEngine
    tokenizer: Any
    model_name: str
    model_path: str
    host: str = "127.0.0.1"
    port: int = 0
    started: float = field(default_factory=time.time)
    weight_label: str | None = None  # a non-numeric /update_weight_version label
    weight_groups: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # name -> (group, device)

    @property
    def weight_version(self) -> str:
        return self.weight_label or str(self.engine.weight_version)


def error_response(message: str, status: int = 400) -> web.Response:
    """SGLang's ErrorResponse body."""
    from aiohttp import web

    body = {"object": "error", "message": message, "type": HTTPStatus(status).phrase,
            "param": None, "code": status}
    return web.json_response(body, status=status)


async def read_json(request: web.Request) -> Any:
    if not request.can_read_body:
        return None
    raw = await request.read()
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"the request body is not valid JSON: {exc}") from exc


def _version_arg(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(
            f"weight_version must be an integer string for palaestra serve, got {value!r}"
        ) from None


def _gen_response(state: ServerState, gen: Any, rid: str, params: dict[str, Any],
                  return_logprob: bool, with_text: bool) -> dict[str, Any]:
    detail = dict(gen.meta.get("finish_reason") or {"type": gen.finish_reason})
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": detail,
        "prompt_tokens": gen.prompt_tokens,
        "weight_version": str(gen.weight_version) if state.weight_label is None
        else state.weight_label,
        "completion_tokens": len(gen.token_ids),
        "cached_tokens": gen.cached_tokens,
        "e2e_latency": gen.meta.get("e2e_latency", 0.0),
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(gen.logprobs, gen.token_ids)]
    out: dict[str, Any] = {"output_ids": list(gen.token_ids), "meta_info": meta}
    if with_text:
        skip = params.get("skip_special_tokens")
        text = state.tokenizer.decode(list(gen.token_ids), skip_special_tokens=skip is not False)
        matched = detail.get("matched")
        if isinstance(matched, str) and not params.get("no_stop_trim") and matched in text:
            text = text[: text.index(matched)]
        out = {"text": text, **out}
    return out


def _normalise_generate(state: ServerState, body: dict[str, Any]
                        ) -> tuple[list[tuple[list[int], dict[str, Any], bool, str]], bool]:
    """One (input_ids, sampling_params, return_logprob, rid) per request; whether it was batched."""
    for key, allowed in _GENERATE_DEFAULT_ONLY.items():
        if body.get(key, allowed[0]) not in allowed:
            raise ConfigError(f"{key!r} is not supported by palaestra serve; leave it unset")
    start = body.get("logprob_start_len")
    if start not in (None, -1) and not (isinstance(start, list) and set(start) <= {-1}):
        raise ConfigError("prompt logprobs (logprob_start_len >= 0) are not supported")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ConfigError("give exactly one of text or input_ids")
    if ids is not None:
        if not ids:
            raise ConfigError("input_ids cannot be empty")
        single = not isinstance(ids[0], list)
        prompts = [ids] if single else ids
    else:
        single = isinstance(text, str)
        texts = [text] if single else text
        prompts = [state.tokenizer.encode(t) for t in texts]
    for p in prompts:
        if not isinstance(p, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                              for t in p):
            raise ConfigError("input_ids must be a list of ints or a list of lists of ints")
    params = body.get("sampling_params")
    plist = params if isinstance(params, list) else [params or {}] * len(prompts)
    if len(plist) != len(prompts):
        raise ConfigError("sampling_params must have one entry per prompt")
    for p in plist:
        sp.check_body(p, sp.SAMPLING_PARAMS, "SamplingParams")
    n = int(plist[0].get("n") or 1)
    if n > 1 and any(int(p.get("n") or 1) != n for p in plist):
        raise ConfigError("every sampling_params entry must have the same n")
    rl = body.get("return_logprob")
    rls = rl if isinstance(rl, list) else [bool(rl)] * len(prompts)
    rid = body.get("rid")
    if isinstance(rid, list):
        if len(rid) != len(prompts):
            raise ConfigError("rid must have one entry per prompt")
        rids = rid
    elif single and n == 1:
        rids = [rid or f"gen-{time.monotonic_ns():x}"]
    else:
        base = rid or f"gen-{time.monotonic_ns():x}"
        rids = [f"{base}_{i}" for i in range(len(prompts) * n)]
    items = []
    for k in range(n):  # parallel sampling: the batch repeated n times, as SGLang expands it
        for i, prompt in enumerate(prompts):
            j = k * len(prompts) + i
            items.append((prompt, plist[i], bool(rls[i]), rids[j] if j < len(rids) else
                          f"{rids[i]}_{k}"))
    return items, not (single and n == 1)


def build_app(state: ServerState) -> web.Application:
    """The aiohttp application with SGLang's native routes and the OpenAI-compatible ones."""
    from aiohttp import web

    from palaestra.rollout.engines import openai_api

    engine = state.engine

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except (ConfigError, EngineError) as exc:
            if request.path.startswith("/v1/"):
                return openai_api.error(str(exc), 503 if isinstance(exc, EngineUnavailableError)
                                        else 400)
            return error_response(str(exc), 503 if isinstance(exc, EngineUnavailableError)
                                  else 400)
        except Exception as exc:  # pragma: no cover - a server bug; say so instead of hanging
            return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)

    async def generate(request: web.Request) -> web.StreamResponse:
        body = sp.check_body(await read_json(request), sp.GENERATE_REQ_INPUT, "GenerateReqInput")
        items, batched = _normalise_generate(state, body)
        with_text = body.get("text") is not None or state.tokenizer is not None
        session = body.get("session_id")
        if body.get("stream"):
            if batched:
                raise ConfigError("streaming is supported for single requests only")
            return await _stream_generate(request, state, items[0], with_text, session)

        async def one(item: tuple[list[int], dict[str, Any], bool, str]) -> dict[str, Any]:
            ids, params, rl, rid = item
            gen = await engine.generate(ids, SamplingParams.from_sglang(params), request_id=rid,
                                        session_id=session)
            return _gen_response(state, gen, rid, params, rl, with_text)

        results = await asyncio.gather(*(one(it) for it in items))
        return web.json_response(results if batched else results[0])

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200 if await engine.health() else 503)

    async def health_generate(request: web.Request) -> web.Response:
        if not await engine.health():
            return web.Response(status=503)
        if engine.stats["running"]:
            return web.Response(status=200)  # busy means alive, as in SGLang
        try:
            await asyncio.wait_for(engine.generate(
                [0], SamplingParams(max_new_tokens=1, temperature=0),
                request_id=f"HEALTH_CHECK_{time.monotonic_ns()}"), timeout=20)
        except (asyncio.TimeoutError, EngineError):
            return web.Response(status=503)
        return web.Response(status=200)

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": state.model_path, "tokenizer_path": state.model_path,
            "is_generation": True, "preferred_sampling_params": None,
            "weight_version": state.weight_version,
        })

    async def server_info(request: web.Request) -> web.Response:
        from palaestra import __version__

        return web.json_response({
            "model_path": state.model_path, "tokenizer_path": state.model_path,
            "served_model_name": state.model_name, "host": state.host, "port": state.port,
            "device": str(engine.device), "dtype": str(engine.dtype).replace("torch.", ""),
            "context_length": engine.max_model_len, "max_running_requests": engine.max_running,
            "max_prefill_tokens": engine.max_prefill_tokens, "weight_version": state.weight_version,
            "skip_tokenizer_init": False, "tp_size": 1, "dp_size": 1,
            "internal_states": [engine.stats], "version": f"palaestra-{__version__}",
            "engine": "palaestra.LocalEngine",
        })

    async def weight_version(request: web.Request) -> web.Response:
        return web.json_response({"weight_version": state.weight_version})

    async def update_weight_version(request: web.Request) -> web.Response:
        body = sp.check_body(await read_json(request), sp.UPDATE_WEIGHT_VERSION_REQ_INPUT,
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

    async def _update(body: dict[str, Any], load: Callable[[int | None], Awaitable[None]]
                      ) -> tuple[bool, str, int]:
        version = _version_arg(body.get("weight_version"))
        paused = 0
        if body.get("abort_all_requests"):
            paused = engine.stats["running"] + engine.stats["waiting"]
            await engine.abort(None)
        try:
            await load(version)
        except (EngineError, ConfigError) as exc:
            return False, f"Failed to update weights: {exc}", paused
        state.weight_label = None
        return True, f"Succeeded to update model weights. Weight version {engine.weight_version}.", paused

    async def _load_tensors(body: dict[str, Any], tensors: Any) -> web.Response:
        """Swap received (name, tensor) pairs in between two steps; SGLang's success answer."""
        async def load(version: int | None) -> None:
            await engine.update_weights(tensors, version=version)

        ok, message, _ = await _update(body, load)
        return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)

    async def update_from_disk(request: web.Request) -> web.Response:
        body = sp.check_body(await read_json(request), sp.UPDATE_WEIGHT_FROM_DISK_REQ_INPUT,
                             "UpdateWeightFromDiskReqInput")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise ConfigError("load_format must be auto or safetensors for palaestra serve")

        async def load(version: int | None) -> None:
            await engine.update_weights(path=body["model_path"], version=version)

        ok, message, paused = await _update(body, load)
        return web.json_response({"success": ok, "message": message,
                                  "num_paused_requests": paused}, status=200 if ok else 400)

    async def update_from_tensor(request: web.Request) -> web.Response:
        from palaestra.rollout.engines.tensor_payload import decode_named_tensors

        body = sp.check_body(await read_json(request), sp.UPDATE_WEIGHTS_FROM_TENSOR_REQ_INPUT,
                             "UpdateWeightsFromTensorReqInput")
        payloads = body["serialized_named_tensors"]
        if not payloads or not all(isinstance(p, str) for p in payloads):
            raise ConfigError("serialized_named_tensors must be a non-empty list of base64 strings")
        if body.get("load_format") not in (None, "safetensors"):
            raise ConfigError(
                f"load_format {body['load_format']!r} is not supported; palaestra serve takes "
                "base64 safetensors payloads (load_format null or 'safetensors')"
            )
        tensors = decode_named_tensors(payloads[0])  # tp rank 0: this server is one rank
        return await _load_tensors(body, tensors)

    async def init_group(request: web.Request) -> web.Response:
        from palaestra.rollout.engines.weight_group import init_weight_group

        body = sp.check_body(await read_json(request), sp.INIT_WEIGHTS_UPDATE_GROUP_REQ_INPUT,
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
        try:  # blocks until the trainer (rank 0) and every server joined: off the event loop,
            # in a daemon thread so that a rendezvous the trainer abandoned cannot block exit
            group = await in_daemon_thread(
                init_weight_group, backend=backend, master_address=body["master_address"],
                master_port=int(body["master_port"]), world_size=int(body["world_size"]),
                rank=int(body["rank_offset"]), group_name=name)
        except (RuntimeError, ValueError, OSError) as exc:  # rendezvous failed or timed out
            return web.json_response({"success": False, "message": (
                f"Failed to initialize custom process group: {exc}.")}, status=400)
        state.weight_groups[name] = (group, engine.device if backend == "nccl" else "cpu")
        return web.json_response({"success": True,
                                  "message": "Succeeded to initialize custom process group."})

    async def update_from_distributed(request: web.Request) -> web.Response:
        from palaestra.rollout.engines.weight_group import receive_tensors

        body = sp.check_body(await read_json(request), sp.UPDATE_WEIGHTS_FROM_DISTRIBUTED_REQ_INPUT,
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
        tensors = await in_daemon_thread(receive_tensors, group, body["names"], body["dtypes"],
                                         body["shapes"], device)
        return await _load_tensors(body, tensors)

    async def destroy_group(request: web.Request) -> web.Response:
        from palaestra.rollout.engines.weight_group import destroy_weight_group

        body = sp.check_body(await read_json(request), sp.DESTROY_WEIGHTS_UPDATE_GROUP_REQ_INPUT,
                             "DestroyWeightsUpdateGroupReqInput")
        entry = state.weight_groups.pop(body.get("group_name", "weight_update_group"), None)
        if entry is None:
            return web.json_response({"success": False, "message": (
                "The group to be destroyed does not exist.")}, status=400)
        await in_daemon_thread(destroy_weight_group, entry[0])
        return web.json_response({"success": True,
                                  "message": "Succeeded to destroy custom process group."})

    async def weights_by_name(request: web.Request) -> web.Response:
        raw = await read_json(request)
        if raw is None:  # GET with a query string instead of SGLang's JSON body
            raw = {k: int(v) if k == "truncate_size" and v.lstrip("-").isdigit() else v
                   for k, v in request.query.items()}
        body = sp.check_body(raw, sp.GET_WEIGHTS_BY_NAME_REQ_INPUT, "GetWeightsByNameReqInput")
        values = engine.get_weight(body["name"], int(body.get("truncate_size", 100)))
        return web.json_response(values)

    async def pause(request: web.Request) -> web.Response:
        body = sp.check_body(await read_json(request), sp.PAUSE_GENERATION_REQ_INPUT,
                             "PauseGenerationReqInput")
        await engine.pause(body.get("mode", "abort"))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(request: web.Request) -> web.Response:
        sp.check_body(await read_json(request), sp.CONTINUE_GENERATION_REQ_INPUT,
                      "ContinueGenerationReqInput")
        await engine.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort(request: web.Request) -> web.Response:
        body = sp.check_body(await read_json(request), sp.ABORT_REQ, "AbortReq")
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
        body = sp.check_body(await read_json(request), sp.RELEASE_MEMORY_OCCUPATION_REQ_INPUT,
                             "ReleaseMemoryOccupationReqInput")
        await engine.release_memory(body.get("tags"))
        return web.json_response(None)

    async def resume_memory(request: web.Request) -> web.Response:
        body = sp.check_body(await read_json(request), sp.RESUME_MEMORY_OCCUPATION_REQ_INPUT,
                             "ResumeMemoryOccupationReqInput")
        await engine.resume_memory(body.get("tags"))
        return web.json_response(None)

    app = web.Application(middlewares=[errors], client_max_size=1 << 32)
    r = app.router
    for path, fn in (("/generate", generate),):
        r.add_post(path, fn)
        r.add_put(path, fn)
    r.add_get("/health", health)
    r.add_get("/health_generate", health_generate)
    r.add_get("/get_model_info", model_info)
    r.add_get("/get_server_info", server_info)
    r.add_get("/get_weight_version", weight_version)
    r.add_post("/update_weight_version", update_weight_version)
    r.add_post("/update_weights_from_disk", update_from_disk)
    r.add_post("/update_weights_from_tensor", update_from_tensor)
    r.add_post("/update_weights_from_distributed", update_from_distributed)
    r.add_post("/init_weights_update_group", init_group)
    r.add_post("/destroy_weights_update_group", destroy_group)
    r.add_route("GET", "/get_weights_by_name", weights_by_name)
    r.add_post("/get_weights_by_name", weights_by_name)
    r.add_post("/pause_generation", pause)
    r.add_post("/continue_generation", resume)
    r.add_post("/abort_request", abort)
    for method in ("GET", "POST"):
        r.add_route(method, "/flush_cache", flush)
        r.add_route(method, "/release_memory_occupation", release)
        r.add_route(method, "/resume_memory_occupation", resume_memory)
    openai_api.add_routes(app, state)
    return app


async def _stream_generate(request: web.Request, state: ServerState,
                           item: tuple[list[int], dict[str, Any], bool, str], with_text: bool,
                           session: str | None) -> web.StreamResponse:
    """SSE stream of cumulative outputs (SGLang's non-incremental streaming), then [DONE]."""
    from aiohttp import web

    from palaestra.rollout.engines.base import Generation

    ids, params, rl, rid = item
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    tokens: list[int] = []
    logprobs: list[float] = []
    agen = state.engine.stream(ids, SamplingParams.from_sglang(params), request_id=rid,
                               session_id=session)
    try:
        async for chunk in agen:
            tokens.extend(chunk.token_ids)
            logprobs.extend(chunk.logprobs)
            gen = chunk.generation or Generation(
                tuple(tokens), tuple(logprobs), "", state.engine.weight_version, len(ids), 0,
                {"finish_reason": None})
            out = _gen_response(state, gen, rid, params, rl, with_text)
            if chunk.generation is None:
                out["meta_info"]["finish_reason"] = None
            await resp.write(b"data: " + json.dumps(out).encode() + b"\n\n")
    except EngineError as exc:
        err = {"error": {"message": str(exc)}}
        await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
    finally:
        with contextlib.suppress(Exception):
            await agen.aclose()
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


__all__ = ["ServerState", "build_app", "error_response", "read_json"]

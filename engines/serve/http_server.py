"""The aiohttp app of `palaestra serve`: SGLang's native HTTP API over a `LocalEngine`.

Endpoints, request bodies and responses follow SGLang's ``http_server.py`` and ``io_struct.py``
(field tables in `sglang_protocol`), so `SGLangEngine` and any SGLang client talk to this server
as to SGLang itself. Differences, all answered with a clear 400: ``/update_weights_from_tensor``
takes SGLang's CUDA IPC / shared-memory pickles (`ipc_payload`, same host) and also base64
safetensors payloads (see `tensor_payload`), weight-update groups (`weight_group`)
take "nccl" on a CUDA engine and also "gloo" (CPU), and multimodal inputs, LoRA, prompt logprobs
and grammars are refused.
The OpenAI-compatible routes live in `openai_api`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from palaestra.asyncio_utils import in_daemon_thread
from palaestra.errors import ConfigError, EngineError
from palaestra.engines.serve import sglang_protocol as sp
from palaestra.engine import EngineUnavailableError, SamplingParams
from palaestra.engines.serve.server_state import (
    HEAVY_BODY_BYTES,
    HEAVY_TOKENS,
    SHUTDOWN_MESSAGE,
    ServerState,
    error_response,
    heavy_body,
    json_bytes,
    read_json,
)
from palaestra.engines.serve.serve_requests import (
    BadRequest,
    SGLangSamplingParams,
    check_n,
    check_token_ids,
    logit_bias,
    new_tokens,
    parse,
    stop_strings,
)

if TYPE_CHECKING:
    from aiohttp import web


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
    "audio_data": (None, []), "lora_id": (None,),
    "session_params": (None,), "custom_logit_processor": (None,),
    "return_hidden_states": (False,), "routed_experts_start_len": (None, 0),
    "return_indexer_topk": (False,), "top_logprobs_num": (None, 0),
    "token_ids_logprob": (None, []), "return_sampling_mask": (None, False),
    "return_entropy": (False,), "require_reasoning": (False,), "max_thinking_tokens": (None,),
    "return_flat_raw_top_logprobs": (False,), "positional_embed_overrides": (None,),
    "bootstrap_host": (None,), "bootstrap_port": (None,), "bootstrap_room": (None,),
}


def _version_arg(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(
            f"weight_version must be an integer string for palaestra serve, got {value!r}"
        ) from None


@dataclass(frozen=True)
class GenItem:
    """One sequence of a /generate request: its prompt, sampling, options and rid."""

    input_ids: list[int]
    sampling: SamplingParams
    params: SGLangSamplingParams
    return_logprob: bool
    rid: str
    return_routed_experts: bool = False  # MoE: meta_info.routed_experts, as SGLang sends it
    lora: str | None = None  # the LoRA adapter it names (SGLang's lora_path), None: default


def _gen_text(state: ServerState, gen: Any, params: SGLangSamplingParams) -> str:
    """SGLang's ``text`` of a /generate answer (tokenizer thread)."""
    detail = gen.meta.get("finish_reason") or {}
    text = str(state.tokenizer.decode(list(gen.token_ids),
                                      skip_special_tokens=params.skip_special_tokens is not False))
    matched = detail.get("matched")
    if isinstance(matched, str) and not params.no_stop_trim and matched in text:
        text = text[: text.index(matched)]
    return text


def _gen_response(state: ServerState, gen: Any, item: GenItem, text: str | None
                  ) -> dict[str, Any]:
    detail = dict(gen.meta.get("finish_reason") or {"type": gen.finish_reason})
    if gen.finish_reason == "abort" and state.aborting:
        detail = {"type": "abort", "message": SHUTDOWN_MESSAGE}
    meta: dict[str, Any] = {
        "id": item.rid,
        "finish_reason": detail,
        "prompt_tokens": gen.prompt_tokens,
        "weight_version": str(gen.weight_version) if state.weight_label is None
        else state.weight_label,
        "completion_tokens": len(gen.token_ids),
        "cached_tokens": gen.cached_tokens,
        "e2e_latency": gen.meta.get("e2e_latency", 0.0),
    }
    if item.return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(gen.logprobs, gen.token_ids)]
    routes = gen.meta.get("routed_experts")
    if item.return_routed_experts and routes is not None:
        from palaestra.engines.local.moe import encode_routed_experts

        meta["routed_experts"] = encode_routed_experts(routes)
    out: dict[str, Any] = {"output_ids": list(gen.token_ids), "meta_info": meta}
    if text is not None:
        out = {"text": text, **out}
    return out


def _gen_event(state: ServerState, gen: Any, item: GenItem, with_text: bool, partial: bool
               ) -> bytes:
    """One SSE event of a /generate stream (tokenizer thread)."""
    out = _gen_response(state, gen, item, _gen_text(state, gen, item.params) if with_text else None)
    if partial:
        out["meta_info"]["finish_reason"] = None
    return b"data: " + json.dumps(out).encode() + b"\n\n"


def _prompt_ids(state: ServerState, ids: Any) -> tuple[list[list[int]], bool]:
    """``input_ids`` (one list or a batch of lists), checked before anything is expanded."""
    if not isinstance(ids, list) or not ids:
        raise BadRequest("input_ids must be a non-empty list of token ids (or of such lists)",
                         "input_ids", "invalid_value")
    single = not isinstance(ids[0], list)
    prompts = [ids] if single else ids
    if len(prompts) > state.limits.max_batch:
        raise BadRequest(f"the batch has {len(prompts)} prompts; this server takes at most "
                         f"{state.limits.max_batch} (palaestra serve --max-batch)", "input_ids",
                         "above_max_value")
    for p in prompts:
        if not isinstance(p, list) or not p:
            raise BadRequest("input_ids must be a list of ints or a list of non-empty lists of "
                             "ints", "input_ids", "invalid_type")
        if len(p) >= state.context:
            raise BadRequest(f"the prompt has {len(p)} tokens; the engine's context is "
                             f"{state.context}", "input_ids", "context_length_exceeded")
        if not all(type(t) is int for t in p):
            raise BadRequest("input_ids must be a list of ints or a list of lists of ints",
                             "input_ids", "invalid_type")
        check_token_ids(p, state.vocab, "input_ids")
    return prompts, single


def _sglang_sampling(state: ServerState, params: SGLangSamplingParams, prompt_len: int
                     ) -> SamplingParams:
    """An engine `SamplingParams` from a validated SGLang ``sampling_params`` object."""
    from dataclasses import replace

    raw = params.model_dump(exclude_none=True)
    stop_ids = raw.pop("stop_token_ids", [])
    raw.pop("stop", None)
    raw.pop("logit_bias", None)
    requested = raw.pop("max_new_tokens", None)
    base = SamplingParams.from_sglang(raw)
    if len(stop_ids) > state.limits.max_token_ids:
        raise BadRequest(f"stop_token_ids has {len(stop_ids)} entries; at most "
                         f"{state.limits.max_token_ids}", "sampling_params.stop_token_ids")
    check_token_ids(stop_ids, state.vocab, "sampling_params.stop_token_ids")
    max_new = new_tokens(requested if requested is not None else min(256, state.context),
                         prompt_len, state.context, state.limits, "max_new_tokens", clamp=True)
    return replace(base, max_new_tokens=max_new, stop_token_ids=tuple(stop_ids),
                   stop=stop_strings(params.stop, state.limits),
                   logit_bias=logit_bias(params.logit_bias, state.vocab, state.limits, None))


def _normalise_generate(state: ServerState, body: Any) -> tuple[list[GenItem], bool]:
    """One `GenItem` per sequence (SGLang's expansion of batches and ``n``); whether batched.

    Runs on the tokenizer thread (validation, tokenization): the event loop only routes.
    """
    body = sp.check_body(body, sp.GENERATE_REQ_INPUT, "GenerateReqInput")
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
        prompts, single = _prompt_ids(state, ids)
    else:
        single = isinstance(text, str)
        texts = [text] if single else text
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a non-empty list of strings", "text",
                             "invalid_type")
        if len(texts) > state.limits.max_batch:
            raise BadRequest(f"the batch has {len(texts)} texts; this server takes at most "
                             f"{state.limits.max_batch} (palaestra serve --max-batch)", "text")
        prompts = [state.encode(t) for t in texts]
        _prompt_ids(state, prompts)
    params = body.get("sampling_params")
    raw_list = params if isinstance(params, list) else [params or {}]
    if isinstance(params, list) and len(params) != len(prompts):
        raise ConfigError("sampling_params must have one entry per prompt")
    parsed = [parse(SGLangSamplingParams, p, prefix="sampling_params") for p in raw_list]
    if not isinstance(params, list):
        parsed = parsed * len(prompts)
    n = parsed[0].n or 1
    if any((p.n or 1) != n for p in parsed):
        raise ConfigError("every sampling_params entry must have the same n")
    check_n(n, state.limits, len(prompts))
    sampling = [_sglang_sampling(state, p, len(ids)) for p, ids in zip(parsed, prompts)]
    rl = body.get("return_logprob")
    rls = rl if isinstance(rl, list) else [bool(rl)] * len(prompts)
    if len(rls) != len(prompts) or not all(isinstance(x, bool) for x in rls):
        raise ConfigError("return_logprob must be a bool or one bool per prompt")
    want_routes = body.get("return_routed_experts", False)
    if want_routes and state.engine.decoder.config.moe is None:
        raise ConfigError("return_routed_experts needs a mixture-of-experts model; this server "
                          "serves a dense one")
    loras = _lora_names(body.get("lora_path"), len(prompts))
    rid = body.get("rid")
    if isinstance(rid, list):
        if len(rid) != len(prompts) or not all(isinstance(r, str) for r in rid):
            raise ConfigError("rid must have one string per prompt")
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
            items.append(GenItem(prompt, sampling[i], parsed[i], rls[i],
                                 rids[j] if j < len(rids) else f"{rids[i]}_{k}",
                                 bool(want_routes), loras[i]))
    return items, not (single and n == 1)


def _lora_names(value: Any, count: int) -> list[str | None]:
    """``lora_path`` of /generate (an adapter's name, one per prompt, or None) per prompt."""
    names = value if isinstance(value, list) else [value] * count
    if len(names) != count or not all(n is None or isinstance(n, str) for n in names):
        raise ConfigError("lora_path must be a loaded adapter's name, or one name (or null) per "
                          "prompt")
    return names


def build_app(state: ServerState) -> web.Application:
    """The aiohttp application with SGLang's native routes and the OpenAI-compatible ones."""
    from aiohttp import web

    from palaestra.engines.serve import completions_api, openai_api

    engine = state.engine

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        """Keys, the shutdown gate, the in-flight count, and errors in the route's shape."""
        from palaestra.engines.serve.serve_guard import OPEN_PATHS, bearer, refusal

        openai_route = request.path.startswith("/v1/")

        def fail(message: str, status: int, param: str | None = None,
                 code: str | None = None) -> web.Response:
            if openai_route:
                return openai_api.error(message, status, param, code)
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

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await read_json(request, state)
        items, batched = await state.compute(heavy_body(request), _normalise_generate, state,
                                             body)
        with_text = body.get("text") is not None or state.tokenizer is not None
        session = body.get("session_id")
        if body.get("stream"):
            if batched:
                raise ConfigError("streaming is supported for single requests only")
            return await _stream_generate(request, state, items[0], with_text, session)

        gens = await asyncio.gather(*(
            engine.generate(it.input_ids, it.sampling, request_id=it.rid, session_id=session,
                            lora=it.lora)
            for it in items))

        def answer() -> bytes:
            results = [_gen_response(state, g, it, _gen_text(state, g, it.params)
                                     if with_text else None) for g, it in zip(gens, items)]
            return json.dumps(results if batched else results[0]).encode()

        out_tokens = sum(len(g.token_ids) for g in gens)
        return json_bytes(await state.compute(out_tokens > HEAVY_TOKENS, answer))

    async def health(request: web.Request) -> web.Response:
        healthy = not state.draining and await engine.health()
        return web.Response(status=200 if healthy else 503)

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

    async def _update(body: dict[str, Any], load: Callable[[int | None], Awaitable[None]]
                      ) -> tuple[bool, str, int]:
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

    async def _load_tensors(body: dict[str, Any], tensors: Any) -> web.Response:
        """Swap received (name, tensor) pairs in between two steps; SGLang's success answer."""
        async def load(version: int | None) -> None:
            await engine.update_weights(tensors, version=version)

        ok, message, _ = await _update(body, load)
        return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)

    async def update_from_disk(request: web.Request) -> web.Response:
        body = sp.check_body(await read_json(request, state), sp.UPDATE_WEIGHT_FROM_DISK_REQ_INPUT,
                             "UpdateWeightFromDiskReqInput")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise ConfigError("load_format must be auto or safetensors for palaestra serve")

        async def load(version: int | None) -> None:
            await engine.update_weights(path=body["model_path"], version=version)

        ok, message, paused = await _update(body, load)
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
        answer = await _load_tensors(body, tensors)
        if shared and engine.device.type == "cuda":
            import torch

            torch.cuda.synchronize(engine.device)
        del tensors
        return answer

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
        return await _load_tensors(body, tensors)

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

    async def weights_by_name(request: web.Request) -> web.Response:
        raw = await read_json(request, state)
        if raw is None:  # GET with a query string instead of SGLang's JSON body
            raw = {k: int(v) if k == "truncate_size" and v.lstrip("-").isdigit() else v
                   for k, v in request.query.items()}
        body = sp.check_body(raw, sp.GET_WEIGHTS_BY_NAME_REQ_INPUT, "GetWeightsByNameReqInput")
        values = engine.get_weight(body["name"], int(body.get("truncate_size", 100)))
        return web.json_response(values)

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

    def _lora_answer(ok: bool, error: str | None) -> web.Response:
        """SGLang's LoRAUpdateOutput: success, error_message, loaded_adapters (name -> path)."""
        runtime = engine.decoder.lora
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

    async def load_lora(request: web.Request) -> web.Response:
        body = _lora_body(await read_json(request, state), ("lora_name", "lora_path"))
        try:
            await engine.load_lora_adapter(body["lora_name"], body["lora_path"])
        except EngineError as exc:
            return _lora_answer(False, str(exc))
        return _lora_answer(True, None)

    async def unload_lora(request: web.Request) -> web.Response:
        body = _lora_body(await read_json(request, state), ("lora_name",))
        try:
            await engine.unload_lora_adapter(body["lora_name"])
        except EngineError as exc:
            return _lora_answer(False, str(exc))
        return _lora_answer(True, None)

    async def close_pool(app: web.Application) -> None:
        state.close_pool()

    # bodies are read by `read_json` with each route's limit; aiohttp's own limit is the largest
    biggest = max(state.options.body_limit("/update_weights_from_tensor"),
                  state.options.body_limit("/generate"))
    app = web.Application(middlewares=[guard], client_max_size=biggest)
    app.on_cleanup.append(close_pool)
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
    r.add_post("/load_lora_adapter", load_lora)
    r.add_post("/unload_lora_adapter", unload_lora)
    for method in ("GET", "POST"):
        r.add_route(method, "/flush_cache", flush)
        r.add_route(method, "/release_memory_occupation", release)
        r.add_route(method, "/resume_memory_occupation", resume_memory)
    openai_api.add_routes(app, state)
    app.router.add_post("/v1/completions", completions_api.handler(state))
    return app


async def _stream_generate(request: web.Request, state: ServerState, item: GenItem,
                           with_text: bool, session: str | None) -> web.StreamResponse:
    """SSE stream of cumulative outputs (SGLang's non-incremental streaming), then [DONE].

    A request aborted by the server's shutdown ends with an error event, then [DONE].
    """
    from aiohttp import web

    from palaestra.engine import Generation

    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    agen = state.engine.stream(item.input_ids, item.sampling, request_id=item.rid,
                               session_id=session, lora=item.lora)
    await resp.prepare(request)
    state.streaming.add(id(request))
    tokens: list[int] = []
    logprobs: list[float] = []
    try:
        async for chunk in agen:
            tokens.extend(chunk.token_ids)
            logprobs.extend(chunk.logprobs)
            gen = chunk.generation or Generation(
                tuple(tokens), tuple(logprobs), "", state.engine.weight_version,
                len(item.input_ids), 0, {"finish_reason": None})
            await resp.write(await state.call(len(tokens) > HEAVY_TOKENS, _gen_event, state, gen,
                                              item, with_text, chunk.generation is None))
            if chunk.generation is not None and chunk.generation.finish_reason == "abort" \
                    and state.aborting:
                raise EngineUnavailableError(SHUTDOWN_MESSAGE)
    except EngineError as exc:
        err = {"error": {"message": str(exc), "code": 503 if isinstance(
            exc, EngineUnavailableError) else 400}}
        await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
    finally:
        with contextlib.suppress(Exception):
            await agen.aclose()
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


__all__ = [
    "HEAVY_BODY_BYTES",
    "HEAVY_TOKENS",
    "SHUTDOWN_MESSAGE",
    "GenItem",
    "ServerState",
    "build_app",
    "error_response",
    "heavy_body",
    "json_bytes",
    "read_json",
]

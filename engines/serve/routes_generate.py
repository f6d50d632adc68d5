"""SGLang's generation routes of `palaestra serve`: ``/generate`` (batched or streamed, the
request normalised as SGLang's ``GenerateReqInput``), health and model/server info.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from palaestra.errors import ConfigError, EngineError
from palaestra.engines.serve import sglang_protocol as sp
from palaestra.engine import EngineUnavailableError, SamplingParams
from palaestra.engines.serve.server_state import (
    HEAVY_TOKENS,
    SHUTDOWN_MESSAGE,
    ServerState,
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


def add_generation_routes(r: web.UrlDispatcher, state: ServerState) -> None:
    """``/generate`` (POST and PUT), ``/health``, ``/health_generate``, ``/model_info`` and
    ``/server_info`` (and their older names ``/get_model_info``, ``/get_server_info``), and
    ``/get_load``."""
    from aiohttp import web

    engine = state.engine

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

    model_card = _model_card(state.model_path)

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": state.model_path, "tokenizer_path": state.model_path,
            "is_generation": True, "preferred_sampling_params": None,
            "weight_version": state.weight_version, "has_image_understanding": False,
            "has_audio_understanding": False, **model_card,
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

    async def load(request: web.Request) -> web.Response:
        return web.json_response([_load(engine)])

    for path, fn in (("/generate", generate),):
        r.add_post(path, fn)
        r.add_put(path, fn)
    r.add_get("/health", health)
    r.add_get("/health_generate", health_generate)
    # current SGLang's names first (the SGLang router asks for them), the older ones beside
    for name, handler in (("model_info", model_info), ("server_info", server_info)):
        r.add_get(f"/{name}", handler)
        r.add_get(f"/get_{name}", handler)
    r.add_get("/get_load", load)


def _model_card(model_path: str) -> dict[str, Any]:
    """``model_type`` and ``architectures`` of the served checkpoint's config.json (None when the
    engine was built in memory), as SGLang's ``/model_info`` reports them."""
    from pathlib import Path

    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    return {"model_type": config.get("model_type"),
            "architectures": config.get("architectures")}


def _load(engine: Any) -> dict[str, Any]:
    """One data-parallel rank's entry of ``/get_load``: requests running and waiting, and the
    tokens their KV holds (what the SGLang router balances on)."""
    running = list(engine._running)
    waiting = int(engine.stats["waiting"])
    held = sum(req.kv_len for req in running)
    return {"dp_rank": 0, "num_reqs": len(running) + waiting, "num_waiting_reqs": waiting,
            "num_tokens": held, "num_pending_tokens": 0, "ts_tic": time.perf_counter()}


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


__all__ = ["GenItem", "add_generation_routes"]

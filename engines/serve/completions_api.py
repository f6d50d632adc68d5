"""OpenAI's legacy ``/v1/completions`` for `palaestra serve`.

The prompt is a string, a list of strings, a list of token ids or a list of such lists (OpenAI's
four forms); each prompt gets ``n`` choices, indexed ``prompt * n + k`` as OpenAI orders them.
``max_tokens`` defaults to 16 as OpenAI's does (0 is allowed: with ``echo`` it returns the
prompt). ``logprobs: 0`` returns the sampled tokens' logprobs (``tokens``, ``token_logprobs``,
``text_offset``); top-k alternatives (``logprobs > 0``), prompt logprobs (``echo`` with
``logprobs``), ``suffix`` and ``best_of > n`` are refused by name, since the engine computes
none of them. ``stream: true`` (one prompt, ``n = 1``) sends text deltas, a usage chunk on
request, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from palaestra.engines.serve.server_state import HEAVY_TOKENS
from palaestra.engines.serve.serve_requests import (
    BadRequest,
    CompletionRequest,
    check_n,
    check_token_ids,
    parse,
)

if TYPE_CHECKING:
    from aiohttp import web

    from palaestra.engine import Generation, SamplingParams
    from palaestra.engines.serve.server_state import ServerState


def _check(req: CompletionRequest) -> int:
    """``n``; what the engine cannot compute is refused by name."""
    n = req.n or 1
    if req.suffix:
        raise BadRequest("'suffix' (insertion) is not supported by palaestra serve", "suffix",
                         "unsupported_parameter")
    if req.best_of is not None and req.best_of != n:
        raise BadRequest("'best_of' other than n is not supported (the server does not rank "
                         "samples); leave it unset", "best_of", "unsupported_value")
    if req.logprobs:
        raise BadRequest("top logprobs (logprobs > 0) are not supported; logprobs: 0 returns "
                         "the sampled tokens' logprobs", "logprobs", "unsupported_value")
    if req.logprobs is not None and req.echo:
        raise BadRequest("prompt logprobs (echo with logprobs) are not supported", "echo",
                         "unsupported_value")
    if req.stream and (n != 1 or not _single(req.prompt)):
        raise BadRequest("stream: true takes one prompt and n = 1", "stream",
                         "unsupported_value")
    return n


def _single(prompt: Any) -> bool:
    return isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], int))


def _prompts(state: ServerState, prompt: Any) -> list[tuple[list[int], str | None]]:
    """(token ids, prompt text when given as text) per prompt (tokenizer thread)."""
    if isinstance(prompt, str):
        raw: list[Any] = [prompt]
    elif isinstance(prompt[0], int):
        raw = [prompt]
    else:
        raw = list(prompt)
    if len(raw) > state.limits.max_batch:
        raise BadRequest(f"the request has {len(raw)} prompts; this server takes at most "
                         f"{state.limits.max_batch}", "prompt", "above_max_value")
    out: list[tuple[list[int], str | None]] = []
    for p in raw:
        if isinstance(p, str):
            out.append((state.encode(p, param="prompt"), p))
            continue
        if not p:
            raise BadRequest("a token-id prompt cannot be empty", "prompt", "invalid_value")
        check_token_ids(p, state.vocab, "prompt")
        out.append((list(p), None))
    for ids, _ in out:
        if not ids:
            raise BadRequest("the prompt has no tokens", "prompt", "invalid_value")
    return out


def _choice(state: ServerState, req: CompletionRequest, index: int, gen: Generation,
            prompt: tuple[list[int], str | None], stop_ids: frozenset[int]) -> dict[str, Any]:
    from palaestra.engines.serve.openai_common import final_text

    tok = state.tokenizer
    text = final_text(tok, gen, stop_ids)
    echo = ""
    if req.echo:
        echo = prompt[1] if prompt[1] is not None else str(tok.decode(prompt[0]))
    logprobs = None
    if req.logprobs is not None:
        ids = list(gen.token_ids)
        if ids and ids[-1] in stop_ids:
            ids = ids[:-1]
        pieces = [str(tok.decode([t])) for t in ids]
        offsets, at = [], len(echo)
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        logprobs = {"tokens": pieces, "token_logprobs": list(gen.logprobs[: len(ids)]),
                    "top_logprobs": None, "text_offset": offsets}
    return {"index": index, "text": echo + text, "logprobs": logprobs,
            "finish_reason": gen.finish_reason}


def handler(state: ServerState) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The ``POST /v1/completions`` handler over the server's state."""

    from palaestra.engines.serve.server_state import heavy_body, json_bytes, read_json
    from palaestra.engines.serve.openai_common import (
        check_model,
        openai_sampling,
        reseed,
        shutdown_abort,
    )

    engine = state.engine

    def prepare(body: Any) -> tuple[CompletionRequest, int, list[tuple[list[int], str | None]],
                                    list[SamplingParams]]:
        """Validate and tokenize (tokenizer thread: the event loop only routes)."""
        req: CompletionRequest = parse(CompletionRequest, body)
        check_model(state, req.model)
        n = _check(req)
        prompts = _prompts(state, req.prompt)
        check_n(n, state.limits, len(prompts))
        for ids, _ in prompts:
            if len(ids) >= state.context:
                raise BadRequest(f"the prompt has {len(ids)} tokens; the context is "
                                 f"{state.context}", "prompt", "context_length_exceeded")
        params = [openai_sampling(state, req, len(ids), req.max_tokens) for ids, _ in prompts]
        return req, n, prompts, params

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await read_json(request, state)
        req, n, prompts, params = await state.compute(heavy_body(request), prepare, body)
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        stop_ids = frozenset(engine.eos_token_ids)
        if req.stream:
            return await _stream(request, state, req, prompts[0][0], params[0], cid, created,
                                 stop_ids)
        jobs = [(i * n + k, i, reseed(params[i], k)) for i in range(len(prompts))
                for k in range(n)]
        gens = list(await asyncio.gather(*(
            engine.generate(prompts[i][0], p, request_id=f"{cid}-{index}")
            for index, i, p in jobs)))
        shutdown_abort(state, gens)

        def answer() -> bytes:
            choices = [_choice(state, req, index, gen, prompts[i], stop_ids)
                       for (index, i, _), gen in zip(jobs, gens)]
            prompt_tokens = sum(len(ids) for ids, _ in prompts)
            completion = sum(len(g.token_ids) for g in gens)
            return json.dumps({
                "id": cid, "object": "text_completion", "created": created,
                "model": state.model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                          "total_tokens": prompt_tokens + completion},
            }).encode()

        out_tokens = sum(len(g.token_ids) for g in gens)
        return json_bytes(await state.compute(out_tokens > HEAVY_TOKENS, answer))

    return completions


async def _stream(request: web.Request, state: ServerState, req: CompletionRequest,
                  ids: list[int], params: Any, cid: str, created: int,
                  stop_ids: frozenset[int]) -> web.StreamResponse:
    from aiohttp import web

    from palaestra.engines.serve.openai_common import end_stream, stream_text

    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    state.streaming.add(id(request))

    async def send(text: str | None, finish: str | None,
                   usage: dict[str, Any] | None = None) -> None:
        choices = [] if text is None else [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
        chunk: dict[str, Any] = {"id": cid, "object": "text_completion", "created": created,
                                 "model": state.model_name, "choices": choices}
        if usage is not None:
            chunk["usage"] = usage
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

    async def send_text(delta: str) -> None:
        await send(delta, None)

    streamed = await stream_text(state, resp, ids, params, cid, stop_ids, False, send_text)
    if streamed is None:
        return await end_stream(resp)
    final, text, sent = streamed
    await send(text[sent:] if len(text) > sent else "", final.finish_reason)
    if req.stream_options is not None and req.stream_options.include_usage:
        await send(None, None, {"prompt_tokens": len(ids),
                                "completion_tokens": len(final.token_ids),
                                "total_tokens": len(ids) + len(final.token_ids)})
    return await end_stream(resp)


__all__ = ["handler"]

"""What the OpenAI-compatible routes of `palaestra serve` share (`openai_api`'s
``/v1/chat/completions`` and `completions_api`'s ``/v1/completions``): OpenAI's error body and
error event, the model check, rendering a chat prompt and decoding completion text, parsing an
assistant message (Hermes ``<tool_call>`` tags into ``tool_calls``), the engine sampling of a
request, and the SSE text stream that both routes' ``stream: true`` answers write.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from palaestra.errors import EngineError
from palaestra.engine import Generation, SamplingParams
from palaestra.engines.serve.server_state import HEAVY_TOKENS
from palaestra.engines.serve.serve_requests import (
    BadRequest,
    logit_bias,
    new_tokens,
    stop_strings,
)
from palaestra.types import Message

if TYPE_CHECKING:
    from palaestra.contracts import Tokenizer
    from aiohttp import web

    from palaestra.engines.serve.server_state import ServerState
    from palaestra.engines.serve.serve_requests import ChatCompletionRequest, CompletionRequest

TOOL_CALL_OPEN = "<tool_call>"
OPENAI_STOP_LIMIT = 4  # OpenAI's bound on ``stop`` sequences


def error(message: str, status: int = 400, param: str | None = None,
          code: str | None = None) -> web.Response:
    """OpenAI's error body."""
    from aiohttp import web

    kind = ("invalid_request_error" if status < 500 else "server_error") if status != 404 \
        else "invalid_request_error"
    if status == 401:
        kind = "authentication_error"
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": code}},
        status=status,
    )


def error_event(message: str, status: int, code: str | None = None) -> bytes:
    """An SSE event carrying OpenAI's error object (sent before ``[DONE]``)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def check_model(state: ServerState, model: str | None) -> None:
    """The served model's name (or path) or nothing; OpenAI's 404 ``model_not_found`` else."""
    if model is None or model in (state.model_name, state.model_path):
        return
    raise BadRequest(f"The model `{model[:200]}` does not exist; this server serves "
                     f"`{state.model_name}` (GET /v1/models).", "model", "model_not_found", 404)


def render_text(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[Any] | None,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The chat-template rendering with the generation prompt (tokenizer thread)."""
    try:
        msgs = [Message.from_dict(m).to_dict() for m in messages]
    except (KeyError, TypeError, ValueError) as exc:
        raise BadRequest(f"invalid message: {exc}", "messages", "invalid_value") from exc
    kwargs = dict(template_kwargs or {})
    reserved = {"tools", "add_generation_prompt", "tokenize", "conversation"} & set(kwargs)
    if reserved:
        raise BadRequest(f"chat_template_kwargs may not set {sorted(reserved)}",
                         "chat_template_kwargs", "invalid_value")
    try:
        return str(tokenizer.apply_chat_template(
            msgs, tools=tools or None, add_generation_prompt=True, tokenize=False, **kwargs))
    except Exception as exc:  # a template raises what it likes (raise_exception, TypeError)
        raise BadRequest(f"the chat template could not render these messages: "
                         f"{type(exc).__name__}: {exc}", "messages", "invalid_value") from exc


def render_prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[Any] | None,
                  template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of the chat-template rendering with the generation prompt."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of chat messages", "messages")
    text = render_text(tokenizer, messages, tools, template_kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def completion_text(tokenizer: Tokenizer, token_ids: list[int], stop_ids: frozenset[int]) -> str:
    """Decoded completion with special tokens kept (tool-call tags) but the final stop token cut."""
    if token_ids and token_ids[-1] in stop_ids:
        token_ids = token_ids[:-1]
    return str(tokenizer.decode(token_ids, skip_special_tokens=False))


def final_text(tokenizer: Tokenizer, gen: Generation, stop_ids: frozenset[int]) -> str:
    """A finished generation's text: the stop token and a matched stop string cut."""
    text = completion_text(tokenizer, list(gen.token_ids), stop_ids)
    finish = cast("Mapping[str, object]", gen.meta.get("finish_reason") or {})  # SGLang's
    matched = finish.get("matched")
    if isinstance(matched, str) and matched in text:
        text = text[: text.index(matched)]
    return text


def parse_assistant(text: str, tools_enabled: bool) -> dict[str, Any]:
    """OpenAI assistant message dict from completion text (tool calls parsed when tools are on)."""
    from palaestra.tool_parsers.hermes import HermesParser

    message: dict[str, Any] = {"role": "assistant", "content": text}
    if not tools_enabled or TOOL_CALL_OPEN not in text:
        return message
    parsed = HermesParser().parse(text)
    calls = [c for c in parsed.tool_calls if c.parse_error is None]
    if not calls:  # nothing decodable: the model wrote text that merely looks like a call
        return message
    message["content"] = parsed.content or None
    if parsed.reasoning_content:
        message["reasoning_content"] = parsed.reasoning_content
    message["tool_calls"] = [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
         "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]
    return message


def openai_sampling(state: ServerState, req: ChatCompletionRequest | CompletionRequest,
                    prompt_len: int, requested: int | None) -> SamplingParams:
    """Engine sampling of an OpenAI request; what the engine cannot do is refused by name."""
    for key in ("frequency_penalty", "presence_penalty"):
        if getattr(req, key) not in (None, 0):
            raise BadRequest(f"'{key}' is not supported by palaestra serve; leave it unset or 0",
                             key, "unsupported_parameter")
    return SamplingParams(
        max_new_tokens=new_tokens(requested, prompt_len, state.context, state.limits),
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        stop=stop_strings(req.stop, state.limits, OPENAI_STOP_LIMIT),
        seed=req.seed,
        ignore_eos=bool(req.ignore_eos),
        logit_bias=logit_bias(req.logit_bias, state.vocab, state.limits),
    )


def reseed(params: SamplingParams, i: int) -> SamplingParams:
    """The ``i``-th of ``n`` seeded samples draws from its own seed (0 keeps the request's)."""
    if params.seed is None or i == 0:
        return params
    return replace(params, seed=(params.seed + i) % (1 << 63))


def shutdown_abort(state: ServerState, gens: list[Generation]) -> None:
    """Answer 503 when the server's shutdown aborted one of these generations."""
    from palaestra.engines.serve.server_state import SHUTDOWN_MESSAGE

    if state.aborting and any(g.finish_reason == "abort" for g in gens):
        raise BadRequest(SHUTDOWN_MESSAGE, None, "server_shutting_down", 503)


async def stream_text(
    state: ServerState, resp: web.StreamResponse, ids: list[int], params: SamplingParams,
    cid: str, stop_ids: frozenset[int], parse_tools: bool,
    send_text: Callable[[str], Awaitable[None]],
) -> tuple[Generation, str, int] | None:
    """Decode a streamed generation and pass each new piece of its visible text to
    ``send_text``; returns the final generation, its whole text and how many characters were
    sent. On an engine error or a shutdown abort it writes the error event and returns None
    (the caller then ends the stream with `end_stream`)."""
    from palaestra.engines.serve.server_state import SHUTDOWN_MESSAGE

    tok = state.tokenizer
    tokens: list[int] = []
    sent = 0
    final = None
    try:
        async for chunk in state.engine.stream(ids, params, request_id=cid):
            tokens.extend(chunk.token_ids)
            if chunk.generation is not None:
                final = chunk.generation
                break
            text = await state.call(len(tokens) > HEAVY_TOKENS, completion_text, tok,
                                    list(tokens), stop_ids)
            if text.endswith("\ufffd"):
                continue  # an incomplete UTF-8 sequence: wait for the next token
            visible = _visible(text, parse_tools, params.stop)
            if len(visible) > sent:
                await send_text(visible[sent:])
                sent = len(visible)
    except EngineError as exc:
        await resp.write(error_event(str(exc), 503))
        return None
    assert final is not None
    if final.finish_reason == "abort" and state.aborting:
        await resp.write(error_event(SHUTDOWN_MESSAGE, 503, "server_shutting_down"))
        return None
    text = await state.call(len(final.token_ids) > HEAVY_TOKENS, final_text, tok, final,
                            stop_ids)
    return final, text, sent


async def end_stream(resp: web.StreamResponse) -> web.StreamResponse:
    """``[DONE]``, then the end of the SSE stream."""
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _visible(text: str, parse_tools: bool, stops: tuple[str, ...]) -> str:
    """The part of the text that is safe to stream as content (no tool call, no stop string)."""
    holds = ((TOOL_CALL_OPEN,) if parse_tools else ()) + stops
    cut = len(text)
    for tag in holds:
        at = text.find(tag)
        if at >= 0:
            cut = min(cut, at)
        else:  # hold back a suffix that may become the tag
            for k in range(min(len(tag) - 1, len(text)), 0, -1):
                if text.endswith(tag[:k]):
                    cut = min(cut, len(text) - k)
                    break
    visible = text[:cut]
    # whitespace may be the separator before a tool call, which the final message strips
    return visible.rstrip() if parse_tools else visible


__all__ = [
    "OPENAI_STOP_LIMIT",
    "TOOL_CALL_OPEN",
    "check_model",
    "completion_text",
    "end_stream",
    "error",
    "error_event",
    "final_text",
    "openai_sampling",
    "parse_assistant",
    "render_prompt",
    "render_text",
    "reseed",
    "shutdown_abort",
    "stream_text",
]

"""The gateway's answers to a finished completion: the OpenAI chat-completion JSON (with its
usage) or its server-sent event stream."""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any

from palaestra.rollout.gateway.gateway import Completion, Gateway

if TYPE_CHECKING:
    from aiohttp import web



def completion_json(done: Completion, model: str, body: dict[str, Any],
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
        "usage": usage_of(done),
        "palaestra": {"sample": done.sample_index, "continued": done.continued},
    }


def usage_of(done: Completion) -> dict[str, Any]:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


async def stream_completion(request: web.Request, done: Completion, model: str,
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
        await send([], usage_of(done))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


__all__ = ["completion_json", "stream_completion", "usage_of"]

"""Qwen/Hermes tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.

The content of the message is the text before the first call (after any ``<think>`` block, which
becomes ``reasoning_content``); calls inside a think block are not calls. Arguments keep the raw
JSON text the model wrote, so the Qwen template re-renders the call token for token.
"""

from __future__ import annotations

from palaestra.tool_parsers.common import (
    decode_json_call,
    guess_name,
    split_reasoning,
    tag_blocks,
)
from palaestra.types import Message, ToolCall

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


class HermesParser:
    """Parser of the Qwen2.5/Qwen3 (Hermes) tool-call format."""

    name = "hermes"

    def parse(self, text: str) -> Message:
        reasoning, body = split_reasoning(text)
        first = body.find(TOOL_CALL_OPEN)
        if first < 0:
            return Message(role="assistant", content=body.strip(), reasoning_content=reasoning)
        calls = tuple(
            _decode(inner, closed, f"call_{i}")
            for i, (inner, closed) in enumerate(tag_blocks(body, TOOL_CALL_OPEN, TOOL_CALL_CLOSE))
        )
        return Message(
            role="assistant",
            content=body[:first].strip(),
            tool_calls=calls,
            reasoning_content=reasoning,
        )


def _decode(inner: str, closed: bool, call_id: str) -> ToolCall:
    raw = inner.strip()
    if not closed:
        return ToolCall(
            name=guess_name(raw),
            arguments=raw,
            id=call_id,
            parse_error=f"unclosed {TOOL_CALL_OPEN} tag: close every call with {TOOL_CALL_CLOSE}",
        )
    call, end = decode_json_call(raw, call_id, where=f"{TOOL_CALL_OPEN}")
    if call.parse_error is None and raw[end:].strip():
        return ToolCall(
            name=call.name,
            arguments=raw,
            id=call_id,
            parse_error=f"unexpected text after the JSON object in {TOOL_CALL_OPEN}: "
            f"{raw[end:].strip()[:40]!r}; put exactly one JSON object in each call",
        )
    return call


__all__ = ["TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "HermesParser"]

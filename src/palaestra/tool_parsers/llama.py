"""Llama 3.x tool calls: JSON ``{"name": ..., "parameters": {...}}`` and ``<|python_tag|>`` calls.

Llama 3.1/3.2 write a custom-tool call as the whole message, a JSON object (several separated by
``;``), optionally after ``<|python_tag|>``. After ``<|python_tag|>`` a built-in tool call reads
``brave_search.call(query="...")`` (-> a call named ``brave_search``) and anything else is code
for the code interpreter (-> a call named ``python`` with ``{"code": ...}``). A message that does
not start with a JSON object is plain content, so answers that merely mention JSON stay answers.
"""

from __future__ import annotations

import ast
import json

from palaestra.tool_parsers.common import decode_json_call, split_reasoning
from palaestra.types import Message, ToolCall

PYTHON_TAG = "<|python_tag|>"


class Llama3Parser:
    """Parser of Llama 3.x JSON and ``<|python_tag|>`` tool calls."""

    name = "llama3"

    def parse(self, text: str) -> Message:
        reasoning, body = split_reasoning(text)
        tag = body.find(PYTHON_TAG)
        if tag >= 0:
            payload = body[tag + len(PYTHON_TAG) :].strip()
            calls = _json_calls(payload) if payload.startswith("{") else [_builtin_call(payload)]
            content = body[:tag].strip()
        else:
            content = body.strip()
            calls = _json_calls(content) if _looks_like_call(content) else []
            if calls:
                content = ""
        return Message(
            role="assistant", content=content, tool_calls=tuple(calls), reasoning_content=reasoning
        )


def _looks_like_call(text: str) -> bool:
    # A JSON object that mentions "name": a broken call is still a (failed) call, while an
    # answer that is some other JSON object stays content.
    return text.startswith("{") and '"name"' in text


def _json_calls(payload: str) -> list[ToolCall]:
    calls: list[ToolCall] = []
    i = 0
    while True:
        while i < len(payload) and payload[i] in " \t\r\n;":
            i += 1
        if i >= len(payload) or payload[i] != "{":
            return calls  # trailing text after the calls is dropped, as Llama's own parser does
        call, used = decode_json_call(payload[i:], f"call_{len(calls)}", where="the JSON tool call")
        calls.append(call)
        i += used


def _builtin_call(payload: str) -> ToolCall:
    """``tool.call(k=v, ...)`` -> a call of ``tool``; any other payload is interpreter code."""
    try:
        node = ast.parse(payload, mode="eval").body
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "call"
            and isinstance(node.func.value, ast.Name)
            and not node.args
            and all(kw.arg for kw in node.keywords)
        ):
            kwargs = {str(kw.arg): ast.literal_eval(kw.value) for kw in node.keywords}
            return ToolCall(name=node.func.value.id, arguments=json.dumps(kwargs), id="call_0")
    except (SyntaxError, ValueError, TypeError):
        pass
    return ToolCall(name="python", arguments=json.dumps({"code": payload}), id="call_0")


__all__ = ["PYTHON_TAG", "Llama3Parser"]

"""Shared pieces of the tool-call parsers: the `Parser` protocol, ``<think>`` splitting, tag
blocks, a JSON object scanner that keeps the raw text of every value, and call numbering.

Parsers never raise on model output: whatever the model wrote becomes an assistant `Message`;
a call that cannot be decoded becomes a `ToolCall` with ``parse_error`` set, which the env turns
into an error observation the model can read.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

from palaestra.types import Message, ToolCall

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

_NAME_RE = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_DECODER = json.JSONDecoder()


@runtime_checkable
class Parser(Protocol):
    """Turns the decoded text of one assistant turn into an assistant `Message`."""

    name: str

    def parse(self, text: str) -> Message: ...


def split_reasoning(text: str) -> tuple[str | None, str]:
    """Split ``<think>R</think>C`` into ``(R, C)``; ``(None, text)`` when there is no think block.

    The opening tag may be missing (templates that put ``<think>`` in the generation prompt). A
    block that is opened but never closed (the turn was cut off while thinking) is all reasoning.
    """
    if THINK_CLOSE in text:
        head, _, tail = text.partition(THINK_CLOSE)
        reasoning = head.split(THINK_OPEN)[-1].strip()
        return reasoning or None, tail.lstrip()
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN):
        return stripped[len(THINK_OPEN) :].strip() or None, ""
    return None, text


def tag_blocks(text: str, open_tag: str, close_tag: str) -> list[tuple[str, bool]]:
    """Every ``open_tag ... close_tag`` block as ``(inner_text, closed)``, in order.

    A block is unclosed when the text ends, or another ``open_tag`` starts, before its
    ``close_tag``; its inner text then runs to that point.
    """
    blocks: list[tuple[str, bool]] = []
    pos = text.find(open_tag)
    while pos >= 0:
        start = pos + len(open_tag)
        close = text.find(close_tag, start)
        nxt = text.find(open_tag, start)
        if close >= 0 and (nxt < 0 or close < nxt):
            blocks.append((text[start:close], True))
            pos = text.find(open_tag, close + len(close_tag))
        else:
            end = nxt if nxt >= 0 else len(text)
            blocks.append((text[start:end], False))
            pos = nxt
    return blocks


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def scan_object(text: str, start: int = 0) -> tuple[dict[str, tuple[Any, str]], int]:
    """Decode the JSON object at ``text[start:]`` (after optional whitespace).

    Returns ``{key: (value, raw_value_text)}`` for its top-level keys and the index just past
    the closing brace. Keeping the raw text lets a tool call carry its arguments exactly as the
    model wrote them, so a re-render reproduces the sampled tokens. Raises ``ValueError`` (a
    ``json.JSONDecodeError`` where json found the problem) on malformed input.
    """
    i = _skip_ws(text, start)
    if text[i : i + 1] != "{":
        raise ValueError(f"expected '{{' at position {i}")
    i = _skip_ws(text, i + 1)
    fields: dict[str, tuple[Any, str]] = {}
    if text[i : i + 1] == "}":
        return fields, i + 1
    while True:
        if text[i : i + 1] != '"':
            raise ValueError(f"expected a quoted key at position {i}")
        key, i = _DECODER.raw_decode(text, i)
        i = _skip_ws(text, i)
        if text[i : i + 1] != ":":
            raise ValueError(f"expected ':' after key {key!r} at position {i}")
        i = _skip_ws(text, i + 1)
        value_start = i
        value, i = _DECODER.raw_decode(text, i)
        fields[key] = (value, text[value_start:i])
        i = _skip_ws(text, i)
        sep = text[i : i + 1]
        if sep == "}":
            return fields, i + 1
        if sep != ",":
            raise ValueError(f"expected ',' or '}}' at position {i}")
        i = _skip_ws(text, i + 1)


def guess_name(raw: str) -> str:
    """The ``"name"`` value of a broken JSON call, if it can be read at all ("" otherwise)."""
    match = _NAME_RE.search(raw)
    if not match:
        return ""
    try:
        return str(json.loads(f'"{match.group(1)}"'))
    except ValueError:
        return match.group(1)


def describe_json_error(exc: ValueError) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at position {exc.pos}"
    return str(exc)


def call_from_fields(fields: dict[str, tuple[Any, str]], raw: str, call_id: str) -> ToolCall:
    """A `ToolCall` from a decoded ``{"name": ..., "arguments"|"parameters": {...}}`` object."""
    name = fields.get("name", (None, ""))[0]
    if not isinstance(name, str) or not name:
        return ToolCall(
            name="",
            arguments=raw,
            id=call_id,
            parse_error='the call has no "name" string; write {"name": ..., "arguments": {...}}',
        )
    args = fields.get("arguments") or fields.get("parameters")
    if args is None:
        arguments = "{}"
    elif isinstance(args[0], str):
        arguments = args[0]  # arguments JSON-encoded as a string (OpenAI wire style)
    else:
        arguments = args[1]  # raw text; the env validates that it is an object
    return ToolCall(name=name, arguments=arguments, id=call_id)


def decode_json_call(raw: str, call_id: str, *, where: str) -> tuple[ToolCall, int]:
    """Decode one JSON call at the start of ``raw``; returns the call and the index past it.

    Malformed JSON gives a call with ``parse_error`` set (and the whole rest as its arguments),
    consuming all of ``raw``.
    """
    try:
        fields, end = scan_object(raw)
    except ValueError as exc:
        error = f"invalid JSON in {where}: {describe_json_error(exc)}"
        return ToolCall(
            name=guess_name(raw), arguments=raw.strip(), id=call_id, parse_error=error
        ), len(raw)
    return call_from_fields(fields, raw[:end].strip(), call_id), end


def number_calls(message: Message, turn: int) -> Message:
    """Give every tool call an id unique within an episode: ``call_<turn>_<i>``.

    Parsers number the calls of one message from 0; tool messages answer calls by id, so an
    episode's calls need ids that do not repeat from turn to turn.
    """
    if not message.tool_calls:
        return message
    calls = tuple(replace(c, id=f"call_{turn}_{i}") for i, c in enumerate(message.tool_calls))
    return replace(message, tool_calls=calls)


__all__ = [
    "THINK_CLOSE",
    "THINK_OPEN",
    "Parser",
    "call_from_fields",
    "decode_json_call",
    "describe_json_error",
    "guess_name",
    "number_calls",
    "scan_object",
    "split_reasoning",
    "tag_blocks",
]

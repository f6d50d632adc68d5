"""Tool use written into the text itself: Search-R1 tags and fenced python blocks.

The message content keeps the whole text (the env may parse it itself, as the Search-R1 env does);
the parser also exposes each request as a `ToolCall` so generic tool envs can run it:

- Search-R1: ``<search>query</search>`` -> ``search`` with ``{"query": ...}``; ``<answer>`` stays
  in the content (`extract_answer` reads it). ``<think>`` tags are part of the protocol and stay
  in the content too.
- Python: ```` ```python ... ``` ```` -> ``python`` with ``{"code": ...}``; a ``<think>`` block
  becomes ``reasoning_content`` and code inside it is not run.

An unclosed tag or fence gives a call with ``parse_error`` set that still carries the partial text.
"""

from __future__ import annotations

import json
import re

from palaestra.tool_parsers.common import split_reasoning, tag_blocks
from palaestra.types import Message, ToolCall

SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"

_FENCE_OPEN = re.compile(r"```(?:python|py|python3)[ \t]*\r?\n")
_FENCE = "```"


class SearchR1Parser:
    """Parser of the Search-R1 tag protocol (``<search>``, ``<answer>``)."""

    name = "search_r1"

    def parse(self, text: str) -> Message:
        _, visible = split_reasoning(text)  # a <search> written while thinking is not a search
        calls = []
        for i, (inner, closed) in enumerate(tag_blocks(visible, SEARCH_OPEN, SEARCH_CLOSE)):
            args = json.dumps({"query": inner.strip()})
            error = (
                None if closed else f"unclosed {SEARCH_OPEN} tag: end the query with {SEARCH_CLOSE}"
            )
            calls.append(ToolCall(name="search", arguments=args, id=f"call_{i}", parse_error=error))
        return Message(role="assistant", content=text.strip(), tool_calls=tuple(calls))


def extract_answer(text: str) -> str | None:
    """The text of the last closed ``<answer>...</answer>`` block, or None."""
    answers = [inner for inner, closed in tag_blocks(text, ANSWER_OPEN, ANSWER_CLOSE) if closed]
    return answers[-1].strip() if answers else None


class PythonBlockParser:
    """Parser of fenced python code blocks (```` ```python ````)."""

    name = "python"

    def parse(self, text: str) -> Message:
        reasoning, body = split_reasoning(text)
        calls = []
        for i, (code, closed) in enumerate(python_blocks(body)):
            error = None if closed else "unclosed ```python block: end the code with ```"
            args = json.dumps({"code": code})
            calls.append(ToolCall(name="python", arguments=args, id=f"call_{i}", parse_error=error))
        return Message(
            role="assistant",
            content=body.strip(),
            tool_calls=tuple(calls),
            reasoning_content=reasoning,
        )


def python_blocks(text: str) -> list[tuple[str, bool]]:
    """Every fenced python block as ``(code, closed)``, in order."""
    blocks: list[tuple[str, bool]] = []
    pos = 0
    while (match := _FENCE_OPEN.search(text, pos)) is not None:
        close = text.find(_FENCE, match.end())
        if close < 0:
            blocks.append((text[match.end() :].rstrip(), False))
            break
        blocks.append((text[match.end() : close].rstrip("\n"), True))
        pos = close + len(_FENCE)
    return blocks


__all__ = [
    "ANSWER_CLOSE",
    "ANSWER_OPEN",
    "SEARCH_CLOSE",
    "SEARCH_OPEN",
    "PythonBlockParser",
    "SearchR1Parser",
    "extract_answer",
    "python_blocks",
]

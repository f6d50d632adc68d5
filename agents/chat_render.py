"""`render_chat`: a Hugging Face tokenizer's chat template rendered without the per-call copies.

``tokenizer.apply_chat_template(..., tokenize=False)`` spends half of its time before the template
runs: it normalizes the messages into dicts, then rebuilds the messages, the tool schemas and the
special tokens out of plain JSON types (`_plain_template_data`, which walks every value through a
chain of ``isinstance`` checks against abstract classes), then aliases reasoning fields. A rollout
worker renders every episode three times (the prompt, and both sides of each observation's token
delta), with the same tool schemas each time, so those copies were a quarter of its CPU.

`render_chat` runs the same compiled template (transformers' own, with its filters, extensions
and sandbox) on the same data: messages without ``None`` values, reasoning fields aliased as
transformers aliases them, the special tokens map and template keywords, every value rebuilt
from plain JSON types, with exact ``dict``/``list``/``str``/number values taken as they are and
anything else handed to transformers' own converter. It returns None, and the caller uses
``apply_chat_template``, when the tokenizer or the installed transformers does not offer the parts
it needs. ``tests/agents/test_chat_render.py`` holds it equal to ``apply_chat_template``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

_EXACT = (str, int, float, bool, type(None))


class _PlainTools(tuple):  # type: ignore[type-arg]
    """Tool schemas rebuilt from plain JSON types by `plain_tools` (fresh dicts nobody else
    holds, in an immutable container): rendered as they are, not converted again."""


def _transformers_parts() -> tuple[Any, Any, tuple[str, ...]] | None:
    try:
        from transformers.utils import chat_template_utils as ctu
    except ImportError:
        return None
    compile_ = getattr(ctu, "_compile_jinja_template", None)
    plain = getattr(ctu, "_plain_template_data", None)
    fields = getattr(ctu, "_REASONING_FIELDS", None)
    if compile_ is None or plain is None or not isinstance(fields, tuple):
        return None
    return compile_, plain, fields


_PARTS: tuple[Any, Any, tuple[str, ...]] | None | bool = False  # False: not looked up yet


def _parts() -> tuple[Any, Any, tuple[str, ...]] | None:
    global _PARTS
    if _PARTS is False:
        _PARTS = _transformers_parts()
    return _PARTS  # type: ignore[return-value]


def _plain(value: Any, slow: Any) -> Any:
    """transformers' `_plain_template_data`, with exact JSON values taken without checks."""
    kind = type(value)
    if kind in _EXACT:
        return value
    if kind is _PlainTools:
        return list(value)
    if kind is dict:
        return {_plain(k, slow): _plain(v, slow) for k, v in value.items()}
    if kind is list:
        return [_plain(v, slow) for v in value]
    return slow(value)  # str/int subclasses, tuples, mappings, numpy scalars, objects


def plain_tools(tools: Sequence[Mapping[str, Any]]) -> Sequence[dict[str, Any]]:
    """``tools`` converted once for every render of an episode (an agent renders its tool
    schemas three times per episode; `render_chat` takes the result as it is)."""
    parts = _parts()
    if parts is None:
        return [dict(t) for t in tools]
    slow = parts[1]
    return _PlainTools(_plain(dict(t), slow) for t in tools)


def is_plain_tools(tools: object) -> TypeGuard[Sequence[dict[str, Any]]]:
    """Whether ``tools`` came from `plain_tools`."""
    return type(tools) is _PlainTools


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[dict[str, Any]] | None,
    add_generation_prompt: bool,
    chat_template: str | None,
    template_kwargs: Mapping[str, Any],
) -> str | None:
    """The text ``tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, ...)``
    renders, or None when this tokenizer must go through ``apply_chat_template`` itself."""
    parts = _parts()
    get_template = getattr(tokenizer, "get_chat_template", None)
    special = getattr(tokenizer, "special_tokens_map", None)
    if parts is None or get_template is None or not isinstance(special, Mapping) or not messages:
        return None
    if tools is not None and any(type(t) is not dict for t in tools):
        return None  # callables become schemas inside transformers
    compile_, slow, reasoning_fields = parts
    compiled = compile_(get_template(chat_template, tools))
    chat = []
    for message in messages:
        if type(message) is not dict:
            return None  # not the renderer's own dicts: let transformers convert it
        data = {k: _plain(v, slow) for k, v in message.items() if v is not None}
        reasoning = next((data[k] for k in reasoning_fields if data.get(k) is not None), None)
        if reasoning is not None:
            data = {"thinking": reasoning, **data, "reasoning_content": reasoning}
        chat.append(data)
    keywords = _plain({**special, **template_kwargs}, slow)
    return str(compiled.render(
        messages=chat,
        tools=_plain(tools, slow),
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **keywords,
    ))


__all__ = ["is_plain_tools", "plain_tools", "render_chat"]

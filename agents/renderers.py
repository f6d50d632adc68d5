"""Renderers: a model family's chat template use plus its output parser.

A `Renderer` holds no tokenizer: it says how messages become template input (whether tools go to
the template, whether structured tool calls are rendered or are already part of the text) and how
sampled text becomes a message. The template itself is the tokenizer's own chat template unless
``chat_template`` overrides it. Families:

- ``qwen`` (aliases ``hermes``, ``qwen2.5``, ``qwen3``): ``tools=`` to the template, Hermes calls.
- ``llama3`` (``llama``, ``llama3.1``, ``llama3.2``): ``tools=`` to the template, JSON calls whose
  arguments go to the template as objects (Llama templates apply ``tojson`` to them).
- ``search_r1`` (``search-r1``): tag protocol in the text; the env's prompt describes the tools.
- ``python`` (``python_blocks``, ``code``): fenced code in the text; the env's prompt describes it.
- ``smollm2`` (``smollm``): SmolLM2-Instruct's tool format (`palaestra.tool_parsers.smollm2`):
  tools in the system turn by its own template, calls kept in the text the model wrote.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from palaestra.agents.chat_render import is_plain_tools, render_chat
from palaestra.errors import ConfigError
from palaestra.tool_parsers import ALIASES as PARSER_ALIASES
from palaestra.tool_parsers import Parser, get_parser
from palaestra.tool_parsers.smollm2 import SMOLLM2_TOOLS_TEMPLATE
from palaestra.types import Message

if TYPE_CHECKING:
    from palaestra.contracts import Tokenizer

# End-of-turn tokens a family may emit besides the template's own turn end and the EOS token.
_COMMON_STOPS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")


@dataclass(frozen=True)
class Renderer:
    """How one model family renders messages for its chat template and parses its output."""

    family: str
    parser: Parser
    tools_in_template: bool = True
    tool_calls_in_template: bool = True
    arguments_as_objects: bool = False
    extra_stop_tokens: tuple[str, ...] = _COMMON_STOPS
    chat_template: str | None = None

    def with_template(self, chat_template: str | None) -> Renderer:
        """The same renderer with another Jinja chat template (None: the tokenizer's own)."""
        return replace(self, chat_template=chat_template)

    def parse(self, text: str) -> Message:
        """The assistant message of one turn's decoded text (stop token already removed)."""
        return self.parser.parse(text)

    def template_messages(self, messages: Sequence[Message]) -> list[dict[str, Any]]:
        """Messages as the dicts the chat template reads."""
        out = []
        for message in messages:
            data = message.to_dict()
            if message.tool_calls and not self.tool_calls_in_template:
                del data["tool_calls"]  # the calls are already written in the content
            elif message.tool_calls and self.arguments_as_objects:
                data["tool_calls"] = [_object_arguments(c) for c in data["tool_calls"]]
            out.append(data)
        return out

    def render(
        self,
        tokenizer: Tokenizer,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] = (),
        add_generation_prompt: bool,
        enable_thinking: bool | None = None,
    ) -> str:
        """The chat template's text of ``messages`` (raises what the template raises)."""
        if self.chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"the tokenizer {type(tokenizer).__name__} has no chat template; load a chat "
                "model's tokenizer or pass chat_template=... (e.g. make_agent(..., "
                "chat_template=TEMPLATE))"
            )
        extra: dict[str, Any] = {}
        if enable_thinking is not None:
            extra["enable_thinking"] = enable_thinking
        data = self.template_messages(messages)
        tool_dicts: Sequence[dict[str, Any]] | None = None
        if tools and self.tools_in_template:
            tool_dicts = tools if is_plain_tools(tools) else [dict(t) for t in tools]
        text: object = render_chat(tokenizer, data, tools=tool_dicts,
                                   add_generation_prompt=add_generation_prompt,
                                   chat_template=self.chat_template, template_kwargs=extra)
        if text is None:  # not a tokenizer `render_chat` renders: its own method
            text = tokenizer.apply_chat_template(
                data,
                tools=[dict(t) for t in tools] if tools and self.tools_in_template else None,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=self.chat_template,
                **extra,
            )
        if not isinstance(text, str):
            raise ConfigError(
                f"apply_chat_template returned {type(text).__name__}, not text; use a "
                "transformers tokenizer with a Jinja chat template"
            )
        return text


def _object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    try:
        args = json.loads(call["function"]["arguments"])
    except ValueError:
        return call  # broken JSON is rendered as the raw text the model wrote
    return {**call, "function": {**call["function"], "arguments": args}}


FAMILIES: dict[str, Renderer] = {
    "qwen": Renderer("qwen", get_parser("hermes")),
    "llama3": Renderer("llama3", get_parser("llama3"), arguments_as_objects=True),
    "search_r1": Renderer(
        "search_r1", get_parser("search_r1"), tools_in_template=False, tool_calls_in_template=False
    ),
    "python": Renderer(
        "python", get_parser("python"), tools_in_template=False, tool_calls_in_template=False
    ),
    "smollm2": Renderer(
        "smollm2", get_parser("smollm2"), chat_template=SMOLLM2_TOOLS_TEMPLATE
    ),
}

# One alias table for families and tool-call formats (`palaestra.tool_parsers.ALIASES`): a name
# resolves to its parser, and the parser to the family that uses it.
_FAMILY_OF_PARSER = {r.parser.name: family for family, r in FAMILIES.items()}
ALIASES: dict[str, str] = {
    name: _FAMILY_OF_PARSER[parser]
    for name, parser in {**PARSER_ALIASES, **{p: p for p in _FAMILY_OF_PARSER}}.items()
    if name not in FAMILIES
}


def get_renderer(family: str | Renderer) -> Renderer:
    """The renderer of a model family (a `Renderer` is returned unchanged)."""
    if isinstance(family, Renderer):
        return family
    key = str(family).strip().lower()
    key = ALIASES.get(key, key)
    if key not in FAMILIES:
        names = sorted(set(FAMILIES) | set(ALIASES))
        raise ConfigError(
            f"unknown agent family {family!r}; choose one of {names}, or pass a Renderer"
        )
    return FAMILIES[key]


__all__ = ["ALIASES", "FAMILIES", "Renderer", "get_renderer"]

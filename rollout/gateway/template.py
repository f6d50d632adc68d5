"""`ChatTokens`: everything the gateway does with text, for one tokenizer and model family.

Rendering, tokenization, the template's turn marks and stop tokens and the token delta after a
sampled turn are `palaestra.agents.templating.ChatTemplate`, the code `palaestra.agents.Agent`
uses: the gateway and the rollout's own loop give the same ids for the same conversation. What is
the gateway's own is answering in the OpenAI wire format (`reply`) and comparing the assistant
messages a client sends back with the replies it was given (`same_reply`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from palaestra.tool_parsers.common import split_reasoning
from palaestra.agents.renderers import Renderer
from palaestra.agents.templating import ChatTemplate, TemplateDeltaError
from palaestra.types import Message

if TYPE_CHECKING:
    from palaestra.contracts import Tokenizer


class ChatTokens(ChatTemplate):
    """The chat template of one model family, plus the gateway's reply format."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        renderer: Renderer | str = "qwen",
        *,
        enable_thinking: bool | None = None,
    ) -> None:
        super().__init__(tokenizer, renderer, enable_thinking=enable_thinking)
        _ = self.stop_token_ids  # probes the marks: a template without turns fails at start
        self.vocab_size = len(tokenizer)

    def tools_key(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """What of a request's tools the model sees: their schemas when the template renders
        them, nothing otherwise (then changing tools does not change the prompt)."""
        return tools_key(tools) if self.renderer.tools_in_template else ""

    def tail_ids(
        self,
        conversation: Sequence[Message],
        new: Sequence[Message],
        tools: Sequence[Mapping[str, Any]],
        *,
        closed: bool,
    ) -> list[int] | None:
        """`ChatTemplate.delta` of ``new`` after the sampled turn; None when the template
        cannot say (the request then starts a new sample)."""
        try:
            return self.delta(conversation, new, tools, closed=closed).ids
        except TemplateDeltaError:
            return None

    # ------------------------------------------------------------------ parsing a reply
    def reply(self, turn_ids: Sequence[int], call_index: int, *, parse_tools: bool = True
              ) -> tuple[dict[str, Any], str]:
        """The OpenAI assistant message for one turn's sampled ids, and its decoded text.

        Families whose tool calls live in the template (Qwen/Hermes, Llama 3) answer with
        structured ``tool_calls`` when every call decodes; a call that does not decode leaves
        the whole text as content (the client sees what the model wrote). Text-protocol families
        (Search-R1, python blocks) answer with the text, as does ``parse_tools=False``
        (``tool_choice: "none"``).
        """
        closed = self.closes_turn(turn_ids)
        text = self.decode(turn_ids[:-1] if closed else turn_ids)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if not (parse_tools and self.renderer.tool_calls_in_template):
            return message, text
        parsed = self.renderer.parse(text)
        reasoning, body = split_reasoning(text)
        calls = parsed.tool_calls
        if calls and all(c.parse_error is None for c in calls):
            message["content"] = parsed.content or None
            message["tool_calls"] = [
                {
                    "id": f"call_{call_index}_{i}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for i, c in enumerate(calls)
            ]
        else:
            message["content"] = body.strip() if calls else parsed.content
        if reasoning:
            message["reasoning_content"] = reasoning
        return message, text


def same_reply(sent: Message, returned: Message) -> bool:
    """Whether an assistant message a client sent back is the reply the gateway returned.

    Surrounding whitespace of the content is ignored, tool-call arguments compare as JSON, call
    ids are ignored, and a client may drop ``reasoning_content`` (most do).
    """
    if sent.role != "assistant":
        return False
    if sent.content.strip() != returned.content.strip():
        return False
    if sent.reasoning_content is not None and (
        (returned.reasoning_content or "").strip() != sent.reasoning_content.strip()
    ):
        return False
    if len(sent.tool_calls) != len(returned.tool_calls):
        return False
    return all(
        a.name == b.name and _json_equal(a.arguments, b.arguments)
        for a, b in zip(sent.tool_calls, returned.tool_calls)
    )


def _json_equal(a: str, b: str) -> bool:
    try:
        return bool(json.loads(a) == json.loads(b))
    except ValueError:
        return a.strip() == b.strip()


def tools_key(tools: Sequence[Mapping[str, Any]]) -> str:
    """A canonical text of a tool list (two requests offer the same tools iff keys agree)."""
    return json.dumps(list(tools), sort_keys=True, separators=(",", ":"), default=str)


__all__ = ["ChatTokens", "same_reply", "tools_key"]

"""`ChatTokens`: everything the gateway does with text, for one tokenizer and model family.

The gateway renders whole conversations with the model's chat template (the agents' `Renderer`),
tokenizes them, decodes sampled tokens and parses them with the family's parser, exactly as
`palaestra.agents.Agent` does. `tail_ids` gives the tokens that follow a sampled assistant turn
when a conversation is extended, cut at the turn-end special token: special tokens are split off
before anything else, so tokenizing from there equals the full tokenization (see `tail_ids`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from palaestra.agents.agent import Agent, TurnMarks
from palaestra.agents.parsing import split_reasoning
from palaestra.agents.renderers import Renderer, get_renderer
from palaestra.types import Message

_BASE_USER = "PALAESTRA-GATEWAY-BASE-USER"
_BASE_ASSISTANT = "PALAESTRA-GATEWAY-BASE-ASSISTANT"


class ChatTokens:
    """Chat-template rendering, tokenization and output parsing of one model family."""

    def __init__(
        self,
        tokenizer: Any,
        renderer: Renderer | str = "qwen",
        *,
        enable_thinking: bool | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.renderer = get_renderer(renderer)
        self.enable_thinking = enable_thinking
        # The agent probes the template's turn delimiters and the stop tokens of the family.
        probe = Agent(tokenizer, self.renderer, max_context=1 << 30)
        self.marks: TurnMarks = probe.marks
        self.stop_token_ids: tuple[int, ...] = probe.stop_token_ids
        self.vocab_size = len(tokenizer)

    # ------------------------------------------------------------------ text <-> ids
    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
    ) -> str:
        return self.renderer.render(
            self.tokenizer,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=self.enable_thinking,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(
            self.tokenizer.decode(
                list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        )

    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of the full conversation with the generation prompt."""
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def tools_key(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """What of a request's tools the model sees: their schemas when the template renders
        them, nothing otherwise (then changing tools does not change the prompt)."""
        return tools_key(tools) if self.renderer.tools_in_template else ""

    # ------------------------------------------------------------------ extending a sample
    def tail_ids(
        self,
        conversation: Sequence[Message],
        new: Sequence[Message],
        tools: Sequence[Mapping[str, Any]],
        *,
        closed: bool,
    ) -> list[int] | None:
        """Ids that follow the last sampled assistant turn of ``conversation`` when ``new``
        messages and the generation prompt are added; None when the template cannot say.

        ``closed``: the sampled turn ended with the turn-end token (else the template's closing
        text is part of the tail). The conversation is rendered without and with the new
        messages; when the first is a prefix of the second (an append-only template) the tail is
        the text after the turn's closing. Templates that rewrite earlier turns once a message is
        added (Qwen3 drops the reasoning of turns before the last user query) fail that test; the
        new messages are then rendered after a fixed ``[system?, user, assistant]`` stand-in and
        cut after the stand-in assistant's closing.
        """
        from jinja2 import TemplateError

        close = self.marks.close_text
        try:
            before = self.render(conversation, tools, add_generation_prompt=False)
            after = self.render([*conversation, *new], tools, add_generation_prompt=True)
        except TemplateError:
            before = after = ""
        if after and after.startswith(before) and before.endswith(close):
            ids = self._after_close(after, len(before) - len(close), closed)
            if ids is not None:
                return ids
        lead = list(conversation[:1]) if conversation and conversation[0].role == "system" else []
        base = [*lead, Message("user", _BASE_USER), Message("assistant", _BASE_ASSISTANT)]
        try:
            after = self.render([*base, *new], tools, add_generation_prompt=True)
        except TemplateError:
            return None
        at = after.find(_BASE_ASSISTANT)
        return self._after_close(after, at + len(_BASE_ASSISTANT) if at >= 0 else -1, closed)

    def _after_close(self, text: str, close_at: int, closed: bool) -> list[int] | None:
        """Ids of ``text`` after a sampled turn whose closing text starts at ``close_at``.

        When the model sampled the turn-end token, the tail starts after it; otherwise the whole
        closing text is part of the tail. None when the closing is not there or the cut is not a
        token boundary.
        """
        marks = self.marks
        if close_at < 0 or not text.startswith(marks.close_text, close_at):
            return None
        sampled_end = marks.end_text if closed and marks.end_text else ""
        cut = close_at + len(sampled_end)
        start = close_at if marks.end_text else 0
        head = self.encode(text[start:cut])
        full = self.encode(text[start:])
        if full[: len(head)] != head:
            return None
        return full[len(head) :]

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
        closed = bool(turn_ids) and turn_ids[-1] in self.stop_token_ids
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

"""`ChatTemplate`: one model family's chat template as text and token ids, and the token delta.

Everything the framework does with a chat template lives here once, for both token-level paths:
`palaestra.agents.Agent` (the rollout's own loop) and the agent gateway
(`palaestra.rollout.gateway`, where an external program sends whole conversations).

- `render`/`encode`/`decode`: the family's `Renderer` over the tokenizer (no special tokens
  added on encode, none skipped on decode).
- `marks`: how the template delimits an assistant turn, probed once by rendering a sentinel
  conversation; `stop_token_ids`: the turn end, the family's extra stop tokens and EOS.
- `delta`: the ids that follow a sampled assistant turn when new (env, tool, user) messages and
  the next generation prompt are added. The conversation is rendered without and with the new
  messages; the added text must extend the old one (string prefix) and the cut after the sampled
  turn must be a token boundary of the re-render (token prefix). Templates that rewrite the last
  turn when a message is added (Qwen3 drops earlier reasoning once a new user query arrives, and
  gives only the last assistant turn an empty think block) fail the first check; then the new
  messages are rendered after a fixed base conversation ``[system?, user, assistant]`` and cut
  after the base assistant turn, found by its sentinel content. The cut lies after the end-of-turn
  token when the model sampled it (else the template's closing text is part of the delta), and
  tokenization starts at that special token, so a delta costs O(delta) tokens to encode.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from palaestra.agents.codec import codec_for
from palaestra.agents.renderers import Renderer, get_renderer
from palaestra.errors import ConfigError, RolloutError
from palaestra.types import Message

if TYPE_CHECKING:
    from palaestra.contracts import Tokenizer

_SENTINEL = "PALAESTRA-SENTINEL-5a1f"
_BASE_USER = "PALAESTRA-BASE-USER"
_BASE_ASSISTANT = "PALAESTRA-BASE-ASSISTANT"


class TemplateDeltaError(RolloutError):
    """The chat template cannot render new messages after a sampled assistant turn."""


@dataclass(frozen=True)
class TurnMarks:
    """How the chat template delimits an assistant turn, probed once per template.

    ``close_text`` is what follows an assistant message's content (``"<|im_end|>\\n"`` for Qwen);
    ``end_text`` is its leading special token (``"<|im_end|>"``), the one the model samples to end
    its turn ("" if there is none); ``start_text`` is the special token that opens a message
    (``"<|im_start|>"``; "" if there is none), used to compare re-renders message by message.
    """

    close_text: str
    end_text: str
    start_text: str


@dataclass(frozen=True)
class TemplateDelta:
    """The ids after a sampled turn, and whether the base-conversation fallback produced them."""

    ids: list[int]
    fell_back: bool


class ChatTemplate:
    """Rendering, tokenization, turn marks and token deltas of one tokenizer and model family."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        renderer: Renderer | str = "qwen",
        *,
        enable_thinking: bool | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.codec = codec_for(tokenizer)  # piecewise, cached encoding (shared per tokenizer)
        self.renderer = get_renderer(renderer)
        self.enable_thinking = enable_thinking
        self._marks: TurnMarks | None = None
        self._stop_ids: tuple[int, ...] | None = None

    @classmethod
    def shared(
        cls,
        tokenizer: Tokenizer,
        renderer: Renderer | str = "qwen",
        *,
        enable_thinking: bool | None = None,
    ) -> ChatTemplate:
        """The process's one template of (tokenizer, family, thinking): its turn marks are probed
        once, not once per agent (a rollout worker pools thousands of agents). A template holds
        no per-episode state, so agents share it."""
        resolved = get_renderer(renderer)
        try:
            by_key = _SHARED.setdefault(tokenizer, {})
        except TypeError:  # not weak-referenceable
            return cls(tokenizer, resolved, enable_thinking=enable_thinking)
        key = (resolved, enable_thinking)
        template = by_key.get(key)
        if template is None:
            template = by_key[key] = cls(tokenizer, resolved, enable_thinking=enable_thinking)
        return template

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
        return self.codec.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.codec.decode(ids)

    def prompt_ids(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]]
    ) -> list[int]:
        """Token ids of the full conversation with the generation prompt."""
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def special_id(self, token: str) -> int | None:
        added = getattr(self.tokenizer, "added_tokens_encoder", {}) or {}
        value = added.get(token)
        return value if isinstance(value, int) else None

    def _leading_special(self, text: str) -> str:
        added = getattr(self.tokenizer, "added_tokens_encoder", {}) or {}
        found = [t for t in added if t and text.startswith(t)]
        return max(found, key=len) if found else ""

    # ------------------------------------------------------------------ turn delimiters
    @property
    def marks(self) -> TurnMarks:
        """The template's turn delimiters, probed by rendering a sentinel conversation."""
        if self._marks is None:
            user = [Message("user", _SENTINEL)]
            probe = [*user, Message("assistant", _SENTINEL)]
            text = self.render(probe, (), add_generation_prompt=False)
            at = text.rfind(_SENTINEL)
            if at < 0 or text.find(_SENTINEL) == at:
                raise ConfigError(
                    "the chat template does not render the content of assistant messages; "
                    "use the model's chat template (or pass chat_template=...)"
                )
            close = text[at + len(_SENTINEL) :]
            no_prompt = self.render(user, (), add_generation_prompt=False)
            prompt = self.render(user, (), add_generation_prompt=True)
            opening = prompt[len(no_prompt) :] if prompt.startswith(no_prompt) else ""
            self._marks = TurnMarks(
                close, self._leading_special(close), self._leading_special(opening)
            )
        return self._marks

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Tokens that end an assistant turn: the template's turn end, the family's, and EOS."""
        if self._stop_ids is None:
            names = [self.marks.end_text, *self.renderer.extra_stop_tokens]
            ids: list[Any] = [self.special_id(name) for name in names if name]
            eos = getattr(self.tokenizer, "eos_token_id", None)
            ids += eos if isinstance(eos, list) else [eos]
            self._stop_ids = tuple(dict.fromkeys(i for i in ids if isinstance(i, int)))
        return self._stop_ids

    def closes_turn(self, turn_ids: Sequence[int]) -> bool:
        """Whether a sampled turn ended with a stop token (the model closed it)."""
        return bool(turn_ids) and turn_ids[-1] in self.stop_token_ids

    def close_rest(self, closed: bool) -> str:
        """The closing text of a sampled turn that was not sampled (all of it unless closed)."""
        marks = self.marks
        if closed and marks.end_text:
            return marks.close_text[len(marks.end_text) :]
        return marks.close_text

    # ------------------------------------------------------------------ the token delta
    def ids_after_close(self, text: str, close: int, *, closed: bool) -> list[int] | None:
        """Ids of ``text`` after a sampled turn whose closing text starts at index ``close``.

        The cut lies after the end token when the model sampled it (``closed``), else before
        the closing text. None when the closing text is not there or the cut is not a token
        boundary of the full tokenization (then the caller falls back).
        """
        marks = self.marks
        if close < 0 or not text.startswith(marks.close_text, close):
            return None
        cut = close + len(marks.close_text) - len(self.close_rest(closed))
        # Added tokens are split off before anything else, so from a special token on the tokens
        # do not depend on the text before it: when the closing text starts with one, tokenizing
        # from there equals the full tokenization (and costs O(delta), not O(conversation)).
        start = close if marks.end_text else 0
        head = self.encode(text[start:cut])
        full = self.encode(text[start:])
        if full[: len(head)] != head:
            return None
        return full[len(head) :]

    def delta(
        self,
        conversation: Sequence[Message],
        new: Sequence[Message],
        tools: Sequence[Mapping[str, Any]],
        *,
        closed: bool,
    ) -> TemplateDelta:
        """The ids that follow the last (sampled) assistant turn of ``conversation`` when ``new``
        messages and the generation prompt are added (see the module docstring).

        ``closed``: the sampled turn ended with the turn-end token. Raises `TemplateDeltaError`
        when the template cannot say.
        """
        from jinja2 import TemplateError

        close_text = self.marks.close_text
        try:
            before = self.render(conversation, tools, add_generation_prompt=False)
            after = self.render([*conversation, *new], tools, add_generation_prompt=True)
        except TemplateError:  # e.g. a template that refuses the parsed turn; the base works
            pass
        else:
            if after.startswith(before) and before.endswith(close_text):
                ids = self.ids_after_close(after, len(before) - len(close_text), closed=closed)
                if ids is not None:
                    return TemplateDelta(ids, False)
        lead = list(conversation[:1]) if conversation and conversation[0].role == "system" else []
        base = [*lead, Message("user", _BASE_USER), Message("assistant", _BASE_ASSISTANT)]
        try:
            after = self.render([*base, *new], tools, add_generation_prompt=True)
        except TemplateError as exc:
            raise TemplateDeltaError(
                f"the chat template cannot render the observation "
                f"{[m.role for m in new]} after an assistant turn: {exc}"
            ) from exc
        at = after.find(_BASE_ASSISTANT)
        ids = self.ids_after_close(
            after, at + len(_BASE_ASSISTANT) if at >= 0 else -1, closed=closed
        )
        if ids is None:
            raise TemplateDeltaError(
                f"the chat template does not close an assistant turn with {close_text!r} before "
                f"the observation {[m.role for m in new]} (or not at a token boundary); pass "
                "the model's own chat template"
            )
        return TemplateDelta(ids, True)


_SHARED: weakref.WeakKeyDictionary[Any, dict[tuple[Renderer, bool | None], ChatTemplate]] = (
    weakref.WeakKeyDictionary()
)

__all__ = ["ChatTemplate", "TemplateDelta", "TemplateDeltaError", "TurnMarks"]

"""`Agent`: one episode's conversation and its exact token ids (token-in/token-out).

The prompt is rendered once by the chat template. After that, sampled tokens are appended exactly
as the engine returned them (loss mask 1, with their logprobs and policy version) and decoded only
to parse the assistant message; environment messages are appended as a token delta (mask 0):
the ids that a full re-render of the conversation has between the end of the sampled turn and the
next generation. Decoded text is never re-tokenized for training.

The delta is found by rendering the conversation without and with the new messages; the added
text must extend the old one (string prefix) and the cut after the sampled turn must be a token
boundary of the full re-render (token prefix). Templates that rewrite the last turn when a message
is added (Qwen3 drops earlier reasoning once a new user query arrives, and gives only the last
assistant turn an empty think block) fail the first check; then the new messages are rendered
after a fixed base conversation ``[system?, user, assistant]`` and cut after the base assistant
turn, found by its sentinel content. The cut lies after the end-of-turn token when the model
sampled it (else the template's closing text is appended with mask 0 too), and tokenization starts
at that special token, so a delta costs O(delta) tokens to encode.

Usage (the rollout loop)::

    agent = Agent(tokenizer, "qwen", max_context=4096)
    agent.start(observation, tools=env.tool_schemas())
    while True:
        if agent.remaining_context() <= 0: stop_reason = TRUNCATED; break
        gen = await engine.generate(agent.input_ids, SamplingParams(
            max_new_tokens=min(budget, agent.remaining_context()),
            stop_token_ids=agent.stop_token_ids))
        action = agent.on_generation(gen)
        obs, reward, terminated, truncated, info = await env.astep(action)
        if terminated or truncated: break
        if not agent.on_observation(obs): stop_reason = TRUNCATED; break
    sample = agent.to_sample(reward=..., stop_reason=...)
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from palaestra.agents.drift import DriftReport, compare_ids
from palaestra.agents.renderers import Renderer, get_renderer
from palaestra.errors import ConfigError, EngineError, RolloutError
from palaestra.tool_parsers import number_calls
from palaestra.types import Message, Sample, StopReason, as_message

if TYPE_CHECKING:  # agents sit below rollout; any object with these fields is accepted
    from palaestra.rollout.engines.base import Generation

_SENTINEL = "PALAESTRA-SENTINEL-5a1f"
_BASE_USER = "PALAESTRA-BASE-USER"
_BASE_ASSISTANT = "PALAESTRA-BASE-ASSISTANT"


@dataclass(frozen=True)
class TurnMarks:
    """How the chat template delimits an assistant turn, probed once per agent.

    ``close_text`` is what follows an assistant message's content (``"<|im_end|>\\n"`` for Qwen);
    ``end_text`` is its leading special token (``"<|im_end|>"``), the one the model samples to end
    its turn ("" if there is none); ``start_text`` is the special token that opens a message
    (``"<|im_start|>"``; "" if there is none), used to compare re-renders message by message.
    """

    close_text: str
    end_text: str
    start_text: str


class Agent:
    """One episode's conversation and its exact token ids.

    Reusable: `start` resets it for the next episode. Besides the methods, read ``messages``
    (the conversation, assistant turns as parsed), ``tools``, ``prompt_len``, ``turn_ends`` (end
    index of each sampled turn), ``truncated`` (the context limit was hit), ``checks_drift``
    (this episode's sample runs the drift check) and ``last_finish_reason``.
    """

    def __init__(
        self,
        tokenizer: Any,
        renderer: Renderer | str = "qwen",
        *,
        max_context: int = 4096,
        enable_thinking: bool | None = None,
        drift_check: bool = False,
        strict_drift: bool = False,
        drift_rate: float = 1.0,
        drift_seed: int | None = None,
    ) -> None:
        if int(max_context) < 1:
            raise ConfigError(f"max_context must be a positive token count, got {max_context}")
        self.tokenizer = tokenizer
        self.renderer = get_renderer(renderer)
        self.max_context = int(max_context)
        self.enable_thinking = enable_thinking
        if not 0.0 <= drift_rate <= 1.0:
            raise ConfigError(f"drift_rate must be in [0, 1], got {drift_rate}")
        self.drift_check = drift_check
        self.strict_drift = strict_drift
        self.drift_rate = drift_rate
        self._rng = random.Random(drift_seed)
        self.checks_drift = False  # whether this episode's to_sample runs the drift check
        self._marks: TurnMarks | None = None
        self._stop_ids: tuple[int, ...] | None = None
        self._reset(())

    def _reset(self, tools: Sequence[Mapping[str, Any]]) -> None:
        self.messages: list[Message] = []
        self.tools: list[dict[str, Any]] = [dict(t) for t in tools]
        self._ids: list[int] = []
        self._mask: list[int] = []
        self._logprobs: list[float] = []
        self._versions: list[int] = []
        self.prompt_len = 0
        self.turn_ends: list[int] = []
        self.truncated = False
        self.last_finish_reason: str | None = None
        self._turn_start: int | None = None  # start of the last sampled turn
        self._awaiting_observation = False  # a sampled turn is waiting for the env's answer
        self._resumable = False  # the last turn was aborted and may be continued
        self._delta_fallbacks = 0

    # ------------------------------------------------------------------ public API

    @property
    def input_ids(self) -> list[int]:
        """Every token so far: the input of the next ``generate``."""
        return list(self._ids)

    @property
    def loss_mask(self) -> tuple[int, ...]:
        return tuple(self._mask)

    @property
    def logprobs(self) -> tuple[float, ...]:
        return tuple(self._logprobs)

    @property
    def versions(self) -> tuple[int, ...]:
        return tuple(self._versions)

    @property
    def num_turns(self) -> int:
        return len(self.turn_ends)

    def remaining_context(self) -> int:
        """Tokens left before ``max_context`` (the largest useful ``max_new_tokens``)."""
        return self.max_context - len(self._ids)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Tokens that end an assistant turn: the template's turn end, the family's, and EOS."""
        if self._stop_ids is None:
            names = [self.marks.end_text, *self.renderer.extra_stop_tokens]
            ids = [self._special_id(name) for name in names if name]
            eos = getattr(self.tokenizer, "eos_token_id", None)
            ids += eos if isinstance(eos, list) else [eos]
            self._stop_ids = tuple(dict.fromkeys(i for i in ids if isinstance(i, int)))
        return self._stop_ids

    @property
    def marks(self) -> TurnMarks:
        """The template's turn delimiters, probed by rendering a sentinel conversation."""
        if self._marks is None:
            user = [Message("user", _SENTINEL)]
            probe = [*user, Message("assistant", _SENTINEL)]
            text = self._render(probe, add_generation_prompt=False, tools=())
            at = text.rfind(_SENTINEL)
            if at < 0 or text.find(_SENTINEL) == at:
                raise ConfigError(
                    "the chat template does not render the content of assistant messages; "
                    "use the model's chat template (or pass chat_template=...)"
                )
            close = text[at + len(_SENTINEL) :]
            no_prompt = self._render(user, add_generation_prompt=False, tools=())
            prompt = self._render(user, add_generation_prompt=True, tools=())
            opening = prompt[len(no_prompt) :] if prompt.startswith(no_prompt) else ""
            self._marks = TurnMarks(
                close, self._leading_special(close), self._leading_special(opening)
            )
        return self._marks

    def start(
        self, observation: Sequence[Message], tools: Sequence[Mapping[str, Any]] = ()
    ) -> None:
        """Begin an episode: render the initial messages and the generation prompt as ids."""
        messages = _as_messages(observation)
        if not messages:
            raise ConfigError("start() needs the initial observation (at least one message)")
        self._reset(tools)
        # agents are reused across episodes: the drift sample is drawn per episode
        self.checks_drift = self.drift_check and (
            self.drift_rate >= 1.0 or self._rng.random() < self.drift_rate
        )
        ids = self._encode(self._render(messages, add_generation_prompt=True))
        self.messages = messages
        self._extend(ids)
        self.prompt_len = len(ids)
        self.truncated = len(ids) >= self.max_context

    def on_generation(self, gen: Generation) -> Message:
        """Append the sampled tokens exactly and parse them into the assistant message.

        After a generation with ``finish_reason == "abort"`` the next call continues the same turn
        (partial rollout): the message is re-parsed from all of the turn's tokens and replaced.
        """
        tokens = [int(t) for t in gen.token_ids]
        logprobs = [float(x) for x in gen.logprobs]
        if len(logprobs) != len(tokens):
            raise EngineError(
                f"the engine returned {len(tokens)} tokens but {len(logprobs)} logprobs; request "
                "the logprob of every sampled token (SGLang: return_logprob=True)"
            )
        if not self.messages:
            raise RolloutError("call start() before on_generation()")
        resume = self._resumable
        if not resume and self._awaiting_observation:
            raise RolloutError(
                "on_generation() after a finished assistant turn: pass the env's observation to "
                "on_observation() first"
            )
        if not resume:
            self._turn_start = len(self._ids)
        self._extend(tokens, logprobs, int(gen.weight_version))
        turn = self._ids[self._turn_start :]
        closed = bool(turn) and turn[-1] in self.stop_token_ids
        text = self._decode(turn[:-1] if closed else turn)
        message = number_calls(self.renderer.parse(text), len(self.turn_ends) - int(resume))
        if resume:
            self.messages[-1] = message
            self.turn_ends[-1] = len(self._ids)
        else:
            self.messages.append(message)
            self.turn_ends.append(len(self._ids))
        self._resumable = gen.finish_reason == "abort" and not closed
        self._awaiting_observation = True
        self.last_finish_reason = gen.finish_reason
        if len(self._ids) >= self.max_context:
            self.truncated = True
        return message

    def on_observation(self, observation: Sequence[Message]) -> bool:
        """Append the env's messages and the next generation prompt as a token delta (mask 0).

        Returns False, appending nothing and setting `truncated`, when the delta would not leave
        room for at least one sampled token within ``max_context``: end the episode with stop
        reason ``truncated``.
        """
        if not self._awaiting_observation:
            raise RolloutError(
                "on_observation() must follow on_generation() (the assistant turn it answers)"
            )
        messages = _as_messages(observation)
        delta = self._delta_ids(messages)
        if len(self._ids) + len(delta) >= self.max_context:
            self.truncated = True
            return False
        self._extend(delta)
        self.messages.extend(messages)
        self._resumable = self._awaiting_observation = False
        return True

    def drift(self) -> DriftReport:
        """Compare the incremental ids with a full re-render of `messages`.

        A conversation that ends with an assistant turn is compared with the turn's closing tokens
        added. In strict mode a mismatch raises `TokenDriftError`.
        """
        from jinja2 import TemplateError

        if not self.messages:
            return DriftReport(0, None, 0, 0)
        ends_with_turn = self._awaiting_observation
        try:
            text = self._render(self.messages, add_generation_prompt=not ends_with_turn)
        except TemplateError as exc:
            n = len(self._ids)
            report = DriftReport(n, 0, n, 0, reference_excerpt=f"<re-render failed: {exc}>")
        else:
            incremental = list(self._ids)
            if ends_with_turn:
                close = len(text) - len(self.marks.close_text)
                closing = self._ids_after_close(text, close)
                incremental += closing if closing is not None else self._encode(self._close_rest())
            start_id = self._special_id(self.marks.start_text)
            separators = () if start_id is None else (start_id,)
            report = compare_ids(
                incremental, self._encode(text), self._decode, separators=separators
            )
        if self.strict_drift:
            report.raise_if_drift()
        return report

    def metrics(self) -> dict[str, float]:
        return {
            "num_turns": float(self.num_turns),
            "num_tokens": float(len(self._ids)),
            "num_sampled": float(sum(self._mask)),
            "delta_fallbacks": float(self._delta_fallbacks),
            "truncated": float(self.truncated),
        }

    def to_sample(
        self,
        *,
        reward: float,
        turn_rewards: Sequence[float] = (),
        stop_reason: StopReason | str,
        env_id: str = "",
        task_id: str = "",
        group_id: str = "",
    ) -> Sample:
        """The episode's token-exact training sample (with the drift check if this episode has it).

        Metrics: ``num_turns``, ``num_tokens``, ``num_sampled``, ``delta_fallbacks``,
        ``truncated``, ``drift_checked`` (0/1) and, when checked, ``drift_mismatches``.
        """
        metrics = self.metrics()
        metrics["drift_checked"] = float(self.checks_drift)
        if self.checks_drift:
            metrics["drift_mismatches"] = float(self.drift().mismatches)
        return Sample(
            token_ids_T=tuple(self._ids),
            loss_mask_T=tuple(self._mask),
            logprobs_T=tuple(self._logprobs),
            versions_T=tuple(self._versions),
            prompt_len=self.prompt_len,
            reward=float(reward),
            turn_rewards=tuple(float(r) for r in turn_rewards),
            stop_reason=StopReason(stop_reason),
            env_id=env_id,
            task_id=task_id,
            group_id=group_id,
            metrics=metrics,
            turn_ends=tuple(self.turn_ends),
        )

    # ------------------------------------------------------------------ internals

    def _render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        return self.renderer.render(
            self.tokenizer,
            messages,
            tools=self.tools if tools is None else tools,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=self.enable_thinking,
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _decode(self, ids: Sequence[int]) -> str:
        return str(
            self.tokenizer.decode(
                list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        )

    def _leading_special(self, text: str) -> str:
        added = getattr(self.tokenizer, "added_tokens_encoder", {}) or {}
        found = [t for t in added if t and text.startswith(t)]
        return max(found, key=len) if found else ""

    def _special_id(self, token: str) -> int | None:
        added = getattr(self.tokenizer, "added_tokens_encoder", {}) or {}
        return added.get(token)

    def _extend(
        self, ids: Sequence[int], logprobs: Sequence[float] | None = None, version: int = -1
    ) -> None:
        self._ids.extend(ids)
        sampled = logprobs is not None
        self._mask.extend([int(sampled)] * len(ids))
        self._logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self._versions.extend([version if sampled else -1] * len(ids))

    def _turn_closed(self) -> bool:
        """Whether the last sampled turn ended with a stop token (the model closed it)."""
        start = self._turn_start
        return start is not None and len(self._ids) > start and self._ids[-1] in self.stop_token_ids

    def _close_rest(self) -> str:
        marks = self.marks
        if self._turn_closed() and marks.end_text:
            return marks.close_text[len(marks.end_text) :]
        return marks.close_text

    def _ids_after_close(self, text: str, close: int) -> list[int] | None:
        """Ids of ``text`` after the sampled turn whose closing text starts at index ``close``.

        The cut lies after the end token when the model sampled it, else before the closing
        text. None when the closing text is not there or the cut is not a token boundary of the
        full tokenization (then the caller falls back).
        """
        marks = self.marks
        if close < 0 or not text.startswith(marks.close_text, close):
            return None
        cut = close + len(marks.close_text) - len(self._close_rest())
        # Added tokens are split off before anything else, so from a special token on the tokens
        # do not depend on the text before it: when the closing text starts with one, tokenizing
        # from there equals the full tokenization (and costs O(delta), not O(conversation)).
        start = close if marks.end_text else 0
        head = self._encode(text[start:cut])
        full = self._encode(text[start:])
        if full[: len(head)] != head:
            return None
        return full[len(head) :]

    def _delta_ids(self, new: Sequence[Message]) -> list[int]:
        from jinja2 import TemplateError

        close_text = self.marks.close_text
        ids = None
        try:
            before = self._render(self.messages, add_generation_prompt=False)
            after = self._render([*self.messages, *new], add_generation_prompt=True)
        except TemplateError:  # e.g. a template that refuses the parsed turn; the base works
            pass
        else:
            if after.startswith(before) and before.endswith(close_text):
                ids = self._ids_after_close(after, len(before) - len(close_text))
        if ids is not None:
            return ids
        # The conversation's text does not simply grow (the template rewrote the last turn, e.g.
        # Qwen3 drops its reasoning, or an empty think block that only the last turn gets):
        # render the new messages after a fixed base conversation and cut after its assistant
        # turn, found by its sentinel content.
        self._delta_fallbacks += 1
        lead = self.messages[:1] if self.messages[0].role == "system" else []
        base = [*lead, Message("user", _BASE_USER), Message("assistant", _BASE_ASSISTANT)]
        try:
            after = self._render([*base, *new], add_generation_prompt=True)
        except TemplateError as exc:
            raise RolloutError(
                f"the chat template cannot render the observation "
                f"{[m.role for m in new]} after an assistant turn: {exc}"
            ) from exc
        at = after.find(_BASE_ASSISTANT)
        ids = self._ids_after_close(after, at + len(_BASE_ASSISTANT) if at >= 0 else -1)
        if ids is None:
            raise RolloutError(
                f"the chat template does not close an assistant turn with {close_text!r} before "
                f"the observation {[m.role for m in new]} (or not at a token boundary); pass "
                "the model's own chat template"
            )
        return ids


def _as_messages(observation: Any) -> list[Message]:
    if isinstance(observation, (Message, str, Mapping)):
        observation = [observation]
    return [as_message(m, role="user") for m in observation]


__all__ = ["Agent", "TurnMarks"]

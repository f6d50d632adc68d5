"""`Agent`: one episode's conversation and its exact token ids (token-in/token-out).

The prompt is rendered once by the chat template. After that, sampled tokens are appended exactly
as the engine returned them (loss mask 1, with their logprobs and policy version) and decoded only
to parse the assistant message; environment messages are appended as a token delta (mask 0):
the ids that a full re-render of the conversation has between the end of the sampled turn and the
next generation. Decoded text is never re-tokenized for training.

The tokens live in a `TokenTranscript` and the delta is computed by `ChatTemplate.delta`
(`palaestra.agents.templating`), the same code the agent gateway uses for the conversations an
external program sends.

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
from typing import TYPE_CHECKING, Any

from palaestra.agents.chat_render import plain_tools
from palaestra.agents.drift import DriftReport, compare_ids
from palaestra.agents.renderers import Renderer
from palaestra.agents.templating import ChatTemplate, TemplateDeltaError, TurnMarks
from palaestra.agents.transcript import TokenTranscript
from palaestra.errors import ConfigError, RolloutError
from palaestra.tool_parsers import number_calls
from palaestra.types import Message, Sample, StopReason, as_message

if TYPE_CHECKING:  # the engine contract lives in core; any object with these fields is accepted
    from palaestra.contracts import Tokenizer
    from palaestra.engine import Generation


class Agent:
    """One episode's conversation and its exact token ids.

    Reusable: `start` resets it for the next episode. Besides the methods, read ``messages``
    (the conversation, assistant turns as parsed), ``tools``, ``prompt_len``, ``turn_ends`` (end
    index of each sampled turn), ``truncated`` (the context limit was hit), ``checks_drift``
    (this episode's sample runs the drift check), ``last_finish_reason``, ``template`` (the
    `ChatTemplate`) and ``transcript`` (the `TokenTranscript` of the episode).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
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
        self.template = ChatTemplate.shared(tokenizer, renderer, enable_thinking=enable_thinking)
        self.tokenizer = tokenizer
        self.renderer = self.template.renderer
        self.max_context = int(max_context)
        self.enable_thinking = enable_thinking
        if not 0.0 <= drift_rate <= 1.0:
            raise ConfigError(f"drift_rate must be in [0, 1], got {drift_rate}")
        self.drift_check = drift_check
        self.strict_drift = strict_drift
        self.drift_rate = drift_rate
        self._rng = random.Random(drift_seed)
        self.checks_drift = False  # whether this episode's to_sample runs the drift check
        self._reset(())

    def _reset(self, tools: Sequence[Mapping[str, Any]]) -> None:
        self.messages: list[Message] = []
        self.tools = [dict(t) for t in tools]
        self.transcript = TokenTranscript()
        self.truncated = False
        self.last_finish_reason: str | None = None
        self._turn_start: int | None = None  # start of the last sampled turn
        self._awaiting_observation = False  # a sampled turn is waiting for the env's answer
        self._resumable = False  # the last turn was aborted and may be continued
        self._delta_fallbacks = 0

    # ------------------------------------------------------------------ public API

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The episode's tool schemas (assign a new list to change them)."""
        return self._tools

    @tools.setter
    def tools(self, tools: list[dict[str, Any]]) -> None:
        self._tools = tools
        # converted once for the episode's renders (three per episode), not on every render
        self._template_tools = plain_tools(tools)

    @property
    def input_ids(self) -> list[int]:
        """Every token so far: the input of the next ``generate``."""
        return list(self.transcript.ids)

    @property
    def loss_mask(self) -> tuple[int, ...]:
        return tuple(self.transcript.mask)

    @property
    def logprobs(self) -> tuple[float, ...]:
        return tuple(self.transcript.logprobs)

    @property
    def versions(self) -> tuple[int, ...]:
        return tuple(self.transcript.versions)

    @property
    def prompt_len(self) -> int:
        return self.transcript.prompt_len

    @property
    def turn_ends(self) -> list[int]:
        return self.transcript.turn_ends

    @property
    def num_turns(self) -> int:
        return len(self.transcript.turn_ends)

    def remaining_context(self) -> int:
        """Tokens left before ``max_context`` (the largest useful ``max_new_tokens``)."""
        return self.max_context - len(self.transcript)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Tokens that end an assistant turn: the template's turn end, the family's, and EOS."""
        return self.template.stop_token_ids

    @property
    def marks(self) -> TurnMarks:
        """The template's turn delimiters, probed by rendering a sentinel conversation."""
        return self.template.marks

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
        ids = self.template.prompt_ids(messages, self._template_tools)
        self.messages = messages
        self.transcript.append_prompt(ids)
        self.truncated = len(ids) >= self.max_context

    def on_generation(self, gen: Generation) -> Message:
        """Append the sampled tokens exactly and parse them into the assistant message.

        After a generation with ``finish_reason == "abort"`` the next call continues the same turn
        (partial rollout): the message is re-parsed from all of the turn's tokens and replaced.
        """
        if not self.messages:
            raise RolloutError("call start() before on_generation()")
        resume = self._resumable
        if not resume and self._awaiting_observation:
            raise RolloutError(
                "on_generation() after a finished assistant turn: pass the env's observation to "
                "on_observation() first"
            )
        ids = self.transcript.ids
        start = self._turn_start if resume and self._turn_start is not None else len(ids)
        self.transcript.append_sampled(gen.token_ids, gen.logprobs, int(gen.weight_version))
        self.transcript.record_routes(getattr(gen, "meta", {}).get("routed_experts"))
        self._turn_start = start
        turn = ids[start:]
        closed = self.template.closes_turn(turn)
        text = self.template.decode(turn[:-1] if closed else turn)
        message = number_calls(self.renderer.parse(text), self.num_turns - int(resume))
        if resume:
            self.messages[-1] = message
            self.turn_ends[-1] = len(ids)
        else:
            self.messages.append(message)
            self.turn_ends.append(len(ids))
        self._resumable = gen.finish_reason == "abort" and not closed
        self._awaiting_observation = True
        self.last_finish_reason = gen.finish_reason
        if len(ids) >= self.max_context:
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
        try:
            delta = self.template.delta(self.messages, messages, self._template_tools,
                                        closed=self._turn_closed())
        except TemplateDeltaError:
            self._delta_fallbacks += 1  # the fallback was tried and failed
            raise
        self._delta_fallbacks += int(delta.fell_back)
        if len(self.transcript) + len(delta.ids) >= self.max_context:
            self.truncated = True
            return False
        self.transcript.append_context(delta.ids)
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
        template = self.template
        ends_with_turn = self._awaiting_observation
        try:
            text = template.render(self.messages, self._template_tools,
                                   add_generation_prompt=not ends_with_turn)
        except TemplateError as exc:
            n = len(self.transcript)
            report = DriftReport(n, 0, n, 0, reference_excerpt=f"<re-render failed: {exc}>")
        else:
            incremental = list(self.transcript.ids)
            if ends_with_turn:
                closed = self._turn_closed()
                close = len(text) - len(template.marks.close_text)
                closing = template.ids_after_close(text, close, closed=closed)
                incremental += (closing if closing is not None
                                else template.encode(template.close_rest(closed)))
            start_id = template.special_id(template.marks.start_text)
            separators = () if start_id is None else (start_id,)
            report = compare_ids(
                incremental, template.encode(text), template.decode, separators=separators
            )
        if self.strict_drift:
            report.raise_if_drift()
        return report

    def metrics(self) -> dict[str, float]:
        return {
            "num_turns": float(self.num_turns),
            "num_tokens": float(len(self.transcript)),
            "num_sampled": float(self.transcript.num_sampled),
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
        return self.transcript.to_sample(
            reward=reward, turn_rewards=turn_rewards, stop_reason=stop_reason, env_id=env_id,
            task_id=task_id, group_id=group_id, metrics=metrics,
        )

    # ------------------------------------------------------------------ internals

    def _turn_closed(self) -> bool:
        """Whether the last sampled turn ended with a stop token (the model closed it)."""
        start = self._turn_start
        return start is not None and self.template.closes_turn(self.transcript.ids[start:])


def _as_messages(observation: Any) -> list[Message]:
    if isinstance(observation, (Message, str, Mapping)):
        observation = [observation]
    return [as_message(m, role="user") for m in observation]


__all__ = ["Agent", "TurnMarks"]

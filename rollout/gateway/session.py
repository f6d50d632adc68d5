"""`Session`: one episode's recorded samples, and the rule that places a request in a sample.

Every chat request of a session is rendered in full with the chat template and tokenized. It
continues an existing sample of the session when

1. **exact**: its token ids start with the sample's recorded ids (prompt + everything sampled and
   added so far) and are longer; the remaining ids are appended with mask 0; or
2. **reconciled**: the full render differs from the recorded ids, but its messages extend the
   sample's conversation: every message the client wrote itself is unchanged and every assistant
   message the gateway returned comes back as returned (content compared without surrounding
   whitespace, tool-call arguments compared as JSON, call ids and a dropped
   ``reasoning_content`` ignored). The recorded sampled ids are then authoritative (a model may
   sample a non-canonical tokenization, or the template may re-render a turn differently, e.g.
   Qwen3 dropping earlier reasoning); only the new messages are rendered, and the ids after the
   sampled turn's end token are appended with mask 0.

Otherwise the agent edited its history (or rewound it, or changed tools the template renders): the
request starts a new sample whose prompt is the full render, ``prefix_breaks`` is counted and the
reason kept in ``break_reasons``. Nothing is ever re-tokenized silently: sampled ids stay exactly
as the engine returned them. Samples are tried newest first, so an agent that interleaves several
conversations (a planner and a worker) gets one sample per conversation.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from palaestra.errors import PalaestraError
from palaestra.engine import SamplingParams
from palaestra.rollout.gateway.ledger import CallRecord, SampleLedger
from palaestra.rollout.gateway.template import ChatTokens, same_reply
from palaestra.types import Message, Sample, StopReason, Turn

#: why a session stopped -> the episode's stop reason
STOP_REASONS: dict[str, StopReason] = {
    "max_calls": StopReason.TRUNCATED,
    "context": StopReason.TRUNCATED,
    "max_samples": StopReason.TRUNCATED,
    "call_timeout": StopReason.TIMEOUT,
    "engine_error": StopReason.ERROR,
    "closed": StopReason.ABORTED,
}


class GatewayError(PalaestraError, RuntimeError):
    """A request the gateway refuses; ``status`` and ``code`` become the HTTP error."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request_error"):
        super().__init__(message, status, code)
        self.message, self.status, self.code = message, int(status), code

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class SessionLimits:
    """Bounds of one session (None: unbounded)."""

    max_calls: int | None = None
    call_timeout_s: float | None = None
    max_context: int = 4096
    max_samples: int = 32


@dataclass
class Plan:
    """Where a request goes: which sample (None = a new one) and the ids to append first."""

    ledger: SampleLedger | None
    context_ids: list[int]
    kind: str  # "new" | "exact" | "reconciled"
    messages: list[Message]
    new_messages: tuple[Message, ...]
    replies_at: set[int] = field(default_factory=set)
    reasons: tuple[str, ...] = ()


class Session:
    """The samples, counters and limits of one episode's chat requests."""

    def __init__(
        self,
        session_id: str,
        chat: ChatTokens,
        sampling: SamplingParams,
        limits: SessionLimits,
        *,
        honor_client_sampling: bool = False,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        self.id = session_id
        self.chat = chat
        self.sampling = sampling
        self.limits = limits
        self.honor_client_sampling = honor_client_sampling
        self.metadata = dict(metadata or {})
        self.samples: list[SampleLedger] = []
        self.calls = 0
        self.counters: Counter[str] = Counter()
        self.break_reasons: list[str] = []
        self.lock = asyncio.Lock()
        self.stopped = asyncio.Event()
        self.stop_reason: str | None = None
        self.stop_detail = ""
        self.last: SampleLedger | None = None
        self.created = time.time()

    # ------------------------------------------------------------------ limits
    def stop(self, reason: str, detail: str = "") -> None:
        """End the session (first reason wins); the episode runner reacts to ``stopped``."""
        if self.stop_reason is None:
            self.stop_reason, self.stop_detail = reason, detail
        self.stopped.set()

    def check_open(self) -> None:
        if self.stop_reason is not None:
            raise GatewayError(
                f"session {self.id!r} is finished ({self.stop_reason}: {self.stop_detail}); "
                "start a new episode",
                409,
                "session_finished",
            )
        if self.limits.max_calls is not None and self.calls >= self.limits.max_calls:
            self.stop("max_calls", f"the episode's budget of {self.limits.max_calls} calls is used")
            raise GatewayError(self.stop_detail, 429, "max_calls_exceeded")

    # ------------------------------------------------------------------ placing a request
    def plan(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]]) -> Plan:
        """Decide where a request goes (see the module docstring); changes nothing."""
        key = self.chat.tools_key(tools)
        full = self.chat.prompt_ids(messages, tools)
        reasons: list[str] = []
        for ledger in reversed(self.samples):
            if not ledger.awaiting:
                continue
            if ledger.tools_key != key:
                reasons.append(f"sample {ledger.index}: the tools changed")
                continue
            n = len(ledger.ids)
            aligned, why = _aligned(ledger, messages)
            new = tuple(messages[len(ledger.conversation) :])
            if len(full) > n and full[:n] == ledger.ids:
                keep = ledger.replies_at if aligned else {
                    i for i in ledger.replies_at
                    if i < len(messages) and messages[i].role == "assistant"
                }
                return Plan(ledger, full[n:], "exact", list(messages), new if aligned else (),
                            set(keep))
            if aligned:
                conv = list(messages[: len(ledger.conversation)])
                tail = self.chat.tail_ids(conv, new, tools, closed=ledger.closed)
                if tail:
                    return Plan(ledger, tail, "reconciled", list(messages), new,
                                set(ledger.replies_at))
                why = "the chat template cannot render the new messages after the sampled turn"
            reasons.append(f"sample {ledger.index}: {why}")
        return Plan(None, full, "new", list(messages), (), set(), tuple(reasons))

    def context_after(self, plan: Plan) -> int:
        base = len(plan.ledger.ids) if plan.ledger is not None else 0
        return base + len(plan.context_ids)

    def commit(
        self,
        plan: Plan,
        tools: Sequence[Mapping[str, Any]],
        reply: Message,
        sampled: Sequence[int],
        logprobs: Sequence[float],
        versions: Sequence[int],
    ) -> CallRecord:
        """Record a finished call: the context ids of ``plan``, then the sampled ids."""
        ledger = plan.ledger
        if ledger is None:
            if self.samples:
                self.counters["prefix_breaks"] += 1
                self.break_reasons.append("; ".join(plan.reasons) or "no sample to continue")
            ledger = SampleLedger(len(self.samples), [dict(t) for t in tools],
                                  self.chat.tools_key(tools))
            ledger.tokens.append_prompt(plan.context_ids)
            self.samples.append(ledger)
        else:
            if ledger.calls:
                ledger.calls[-1].observation = plan.new_messages
            ledger.tokens.append_context(plan.context_ids)
            self.counters[f"{plan.kind}_continuations"] += 1
        ledger.conversation = list(plan.messages)
        ledger.replies_at = set(plan.replies_at)
        start = len(ledger.ids)
        ledger.tokens.append_sampled(sampled, logprobs, versions)
        record = CallRecord(self.calls, reply, start, len(ledger.ids), plan.kind)
        ledger.add_reply(record, self.chat.stop_token_ids)
        self.calls += 1
        self.counters["context_tokens"] += len(plan.context_ids)
        self.counters["sampled_tokens"] += len(sampled)
        self.counters["tool_calls"] += len(reply.tool_calls)
        self.last = ledger
        return record

    # ------------------------------------------------------------------ results
    def metrics(self) -> dict[str, float]:
        """Counters of the session: calls, samples, prefix_breaks, continuations, tokens, ..."""
        out = {k: float(v) for k, v in self.counters.items()}
        out["calls"] = float(self.calls)
        out["samples"] = float(len(self.samples))
        out.setdefault("prefix_breaks", 0.0)
        return out

    def messages(self) -> tuple[Message, ...]:
        """The conversation of the most recently used sample, with its last reply."""
        return tuple(self.last.conversation) if self.last is not None else ()

    def turns(self, reward: float) -> tuple[Turn, ...]:
        """One `Turn` per call in call order; the final reward is on the last one."""
        pairs = sorted((i, t) for ledger in self.samples for i, t in ledger.turns())
        turns = [t for _, t in pairs]
        if turns:
            last = turns[-1]
            turns[-1] = Turn(last.action, last.observation, float(reward), dict(last.info))
        return tuple(turns)

    def to_samples(
        self,
        *,
        reward: float,
        stop_reason: StopReason,
        env_id: str = "",
        task_id: str = "",
        group_id: str = "",
    ) -> tuple[Sample, ...]:
        """Every recorded sample with the episode's reward (samples without calls are left out)."""
        return tuple(
            ledger.to_sample(
                reward=reward,
                stop_reason=stop_reason,
                env_id=env_id,
                task_id=task_id,
                group_id=group_id,
                metrics={"sample_index": float(ledger.index), "calls": float(len(ledger.calls))},
            )
            for ledger in self.samples
            if ledger.calls
        )

    def summary(self) -> dict[str, Any]:
        """JSON view for ``GET /sessions/{id}``."""
        return {
            "session_id": self.id,
            "calls": self.calls,
            "stop_reason": self.stop_reason,
            "stop_detail": self.stop_detail,
            "metrics": self.metrics(),
            "break_reasons": list(self.break_reasons),
            "samples": [
                {"index": s.index, "tokens": len(s.ids), "sampled": s.num_sampled,
                 "prompt_len": s.prompt_len, "calls": len(s.calls)}
                for s in self.samples
            ],
            "metadata": self.metadata,
        }


def _aligned(ledger: SampleLedger, messages: Sequence[Message]) -> tuple[bool, str]:
    """Whether ``messages`` extend the ledger's conversation (see the module docstring)."""
    conv = ledger.conversation
    for i, (sent, ours) in enumerate(zip(messages, conv)):
        if i in ledger.replies_at:
            if not same_reply(sent, ours):
                return False, f"message {i} (assistant) differs from the reply the gateway returned"
        elif sent != ours:
            return False, f"message {i} ({sent.role}) was edited"
    if len(messages) <= len(conv):
        return False, (
            f"the request has {len(messages)} messages and the sample's conversation already "
            f"{len(conv)}: the history was cut or the call repeated"
        )
    return True, ""


__all__ = ["STOP_REASONS", "GatewayError", "Plan", "Session", "SessionLimits"]

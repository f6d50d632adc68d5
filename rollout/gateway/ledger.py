"""`SampleLedger`: the exact tokens of one sample that a gateway session records.

A sample is one token sequence the policy saw (a `palaestra.agents.TokenTranscript`, as in the
rollout's `Agent`): the first request's rendered prompt (mask 0), then for every call the sampled tokens exactly as the engine returned them (mask 1, with their logprobs
and the weight version of each token), and between calls the tokens of the messages the client
added (mask 0). Next to the tokens the ledger keeps the conversation as the client sent it with
the replies the gateway returned, and which positions hold those replies, so that the next request
can be matched against it message by message (see `palaestra.rollout.gateway.session`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from palaestra.agents.transcript import TokenTranscript
from palaestra.types import Message, Sample, StopReason, Turn


@dataclass
class CallRecord:
    """One completion: the reply, the messages the client answered it with, how it started."""

    index: int  # call number within the session
    reply: Message
    start: int  # token index where the sampled tokens begin
    end: int  # token index after them
    continued: str  # "new" | "exact" | "reconciled": how the request joined the sample
    observation: tuple[Message, ...] = ()  # messages the next request of this sample added


@dataclass
class SampleLedger:
    """The `TokenTranscript` of one sample, plus its conversation and calls."""

    index: int
    tools: list[dict[str, Any]]
    tools_key: str
    tokens: TokenTranscript = field(default_factory=TokenTranscript)
    conversation: list[Message] = field(default_factory=list)
    replies_at: set[int] = field(default_factory=set)  # positions of gateway replies
    calls: list[CallRecord] = field(default_factory=list)
    closed: bool = True  # the last sampled turn ended with a stop token

    @property
    def ids(self) -> list[int]:
        """The sample's token ids so far (read them, append through ``tokens``)."""
        return self.tokens.ids

    @property
    def prompt_len(self) -> int:
        return self.tokens.prompt_len

    @property
    def awaiting(self) -> bool:
        """The conversation ends with a reply of the gateway: a request may continue it."""
        return bool(self.conversation) and (len(self.conversation) - 1) in self.replies_at

    @property
    def num_sampled(self) -> int:
        return self.tokens.num_sampled

    def add_reply(self, record: CallRecord, stop_token_ids: Sequence[int]) -> None:
        self.replies_at.add(len(self.conversation))
        self.conversation.append(record.reply)
        self.calls.append(record)
        self.tokens.turn_ends.append(record.end)
        turn = self.ids[record.start : record.end]
        self.closed = bool(turn) and turn[-1] in stop_token_ids

    def to_sample(
        self,
        *,
        reward: float,
        stop_reason: StopReason,
        env_id: str = "",
        task_id: str = "",
        group_id: str = "",
        metrics: Mapping[str, float] | None = None,
    ) -> Sample:
        """The training sample; the final reward goes on the last turn (per-turn rewards)."""
        turns = len(self.calls)
        turn_rewards = tuple([0.0] * (turns - 1) + [float(reward)]) if turns else ()
        return self.tokens.to_sample(
            reward=reward, turn_rewards=turn_rewards, stop_reason=stop_reason, env_id=env_id,
            task_id=task_id, group_id=group_id, metrics=metrics,
        )

    def turns(self) -> list[tuple[int, Turn]]:
        """(call index, Turn) of every call of this sample (rewards are set by the caller)."""
        return [(c.index, Turn(c.reply, c.observation, 0.0, {"sample": self.index}))
                for c in self.calls]


__all__ = ["CallRecord", "SampleLedger"]

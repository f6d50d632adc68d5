"""`TokenTranscript`: the exact token ids of one training sample and what each token is.

A transcript is append-only. Context tokens (the rendered prompt, template deltas of env, tool
and user messages) get loss mask 0, logprob 0 and version -1; sampled tokens are appended exactly
as the engine returned them, with mask 1, their logprobs and the weight version that sampled each
one. ``turn_ends`` marks where each sampled turn ends. Both token-level paths record their samples
in one: `palaestra.agents.Agent` and the agent gateway's `SampleLedger`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from palaestra.errors import EngineError
from palaestra.types import Sample, StopReason


@dataclass
class TokenTranscript:
    """Token ids, loss mask, rollout logprobs and policy versions of one sample."""

    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    prompt_len: int = 0
    turn_ends: list[int] = field(default_factory=list)
    #: MoE: the engine's routed experts ``[positions, layers, top_k]`` of the latest generation,
    #: whose prompt was this transcript, so they cover every earlier generation's positions too
    routed_experts: Any = None

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def num_sampled(self) -> int:
        return sum(self.mask)

    def append_context(self, ids: Sequence[int]) -> None:
        """Tokens the policy did not sample (prompt, env/tool/user messages): mask 0."""
        self.ids.extend(map(int, ids))
        self.mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([-1] * len(ids))

    def append_prompt(self, ids: Sequence[int]) -> None:
        """The first context tokens of the sample (its prompt)."""
        self.append_context(ids)
        self.prompt_len = len(self.ids)

    def append_sampled(
        self, ids: Sequence[int], logprobs: Sequence[float], versions: int | Sequence[int]
    ) -> None:
        """Tokens exactly as the engine sampled them (mask 1); ``versions`` is one weight
        version for all of them or one per token."""
        if len(logprobs) != len(ids):
            raise EngineError(
                f"the engine returned {len(ids)} tokens but {len(logprobs)} logprobs; request "
                "the logprob of every sampled token (SGLang: return_logprob=True)"
            )
        per_token = [int(versions)] * len(ids) if isinstance(versions, int) else list(versions)
        if len(per_token) != len(ids):
            raise EngineError(f"{len(ids)} sampled tokens but {len(per_token)} weight versions")
        self.ids.extend(map(int, ids))
        self.mask.extend([1] * len(ids))
        self.logprobs.extend(map(float, logprobs))
        self.versions.extend(map(int, per_token))

    def record_routes(self, routes: Any) -> None:
        """Keep a generation's ``meta["routed_experts"]`` (None: the engine sent none)."""
        if routes is not None:
            self.routed_experts = routes

    def _routes_per_token(self) -> Any:
        """``[len(ids), layers, top_k]`` int16, -1 after the positions the engine ran."""
        if self.routed_experts is None:
            return None
        import torch

        routes = torch.as_tensor(self.routed_experts)
        full = torch.full((len(self.ids), *routes.shape[1:]), -1, dtype=torch.int16)
        n = min(len(self.ids), routes.shape[0])
        full[:n] = routes[:n]
        return full

    def to_sample(
        self,
        *,
        reward: float,
        turn_rewards: Sequence[float] = (),
        stop_reason: StopReason | str,
        env_id: str = "",
        task_id: str = "",
        group_id: str = "",
        metrics: Mapping[str, float] | None = None,
    ) -> Sample:
        """The frozen training sample of these tokens."""
        return Sample(
            token_ids_T=tuple(self.ids),
            loss_mask_T=tuple(self.mask),
            logprobs_T=tuple(self.logprobs),
            versions_T=tuple(self.versions),
            prompt_len=self.prompt_len,
            reward=float(reward),
            turn_rewards=tuple(float(r) for r in turn_rewards),
            stop_reason=StopReason(stop_reason),
            env_id=env_id,
            task_id=task_id,
            group_id=group_id,
            metrics=dict(metrics or {}),
            turn_ends=tuple(self.turn_ends),
            routed_experts=self._routes_per_token(),
        )


__all__ = ["TokenTranscript"]

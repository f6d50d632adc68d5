"""Batches for the trainers: ``TrainBatch`` (ragged, one entry per sequence).

A ``TrainBatch`` holds one 1-D tensor per sequence for the token ids and for every per-token
field (loss mask, advantages, old/reference/rollout logprobs, critic values and returns). All
per-token fields are aligned with the token positions: ``field[t]`` belongs to token ``t``, so a
logprob at ``t`` is ``log pi(token_t | tokens_<t)`` (the convention of ``Sample.logprobs_T``).
The first token of a sequence has no context and can never be trained on.

Its micro-batches (packed or padded rows, token-balanced) are `palaestra.trainers.micro_batches`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from palaestra.errors import ConfigError, TrajectoryValidationError
from palaestra.types import Sample

#: per-token float fields of a TrainBatch (besides token_ids)
TOKEN_FIELDS = (
    "loss_mask",
    "advantages",
    "old_logprobs",
    "ref_logprobs",
    "rollout_logprobs",
    "old_values",
    "returns",
)

Ragged = tuple[torch.Tensor, ...]


def _as_tensor_tuple(values: Iterable[Any], dtype: torch.dtype) -> Ragged:
    return tuple(torch.as_tensor(v, dtype=dtype).reshape(-1).detach().cpu() for v in values)


def pad_ragged(values: Sequence[torch.Tensor], pad_value: float = 0.0) -> torch.Tensor:
    """Right-pad 1-D tensors into ``[N, T_max]``."""
    if not values:
        return torch.zeros(0, 0)
    width = max(int(v.shape[0]) for v in values)
    out = torch.full((len(values), width), pad_value, dtype=values[0].dtype)
    for i, v in enumerate(values):
        out[i, : v.shape[0]] = v
    return out


def unpad(padded: torch.Tensor, lengths: Sequence[int]) -> Ragged:
    """Inverse of ``pad_ragged``: row ``i`` cut to ``lengths[i]``."""
    return tuple(padded[i, :n].clone() for i, n in enumerate(lengths))


@dataclass(frozen=True)
class TrainBatch:
    """Ragged training batch: one 1-D tensor per sequence for tokens and per-token fields.

    ``group_ids`` name each sequence's group (prompt) for group baselines and group-level loss
    aggregation; ``paired`` marks DPO batches where sequences ``2k`` and ``2k+1`` are the
    chosen and rejected completion of pair ``k`` (they always share a micro-batch).
    """

    token_ids: Ragged
    loss_mask: Ragged
    advantages: Ragged | None = None
    old_logprobs: Ragged | None = None
    ref_logprobs: Ragged | None = None
    rollout_logprobs: Ragged | None = None
    old_values: Ragged | None = None
    returns: Ragged | None = None
    group_ids: tuple[str, ...] | None = None
    rewards: torch.Tensor | None = None
    turn_rewards: tuple[tuple[float, ...], ...] | None = None
    turn_ends: tuple[tuple[int, ...], ...] | None = None
    paired: bool = False
    #: MoE routing replay: per sequence an int ``[T, layers, top_k]`` of the experts the rollout
    #: engine chose at each token (-1: not recorded), or None for a sequence without them
    routed_experts: tuple[torch.Tensor | None, ...] | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if self.routed_experts is not None:
            set_(self, "routed_experts", tuple(
                None if r is None else torch.as_tensor(r) for r in self.routed_experts))
        set_(self, "token_ids", _as_tensor_tuple(self.token_ids, torch.long))
        for name in TOKEN_FIELDS:
            value = getattr(self, name)
            if value is not None:
                set_(self, name, _as_tensor_tuple(value, torch.float32))
        if self.rewards is not None:
            set_(self, "rewards", torch.as_tensor(self.rewards, dtype=torch.float32).reshape(-1))
        if self.group_ids is not None:
            set_(self, "group_ids", tuple(str(g) for g in self.group_ids))
        self._validate()

    def _validate(self) -> None:
        n = len(self.token_ids)
        lengths = self.lengths
        for name in TOKEN_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if len(value) != n:
                raise TrajectoryValidationError(
                    f"TrainBatch.{name} has {len(value)} sequences but token_ids has {n}"
                )
            bad = [i for i, (v, t) in enumerate(zip(value, lengths)) if v.shape[0] != t]
            if bad:
                raise TrajectoryValidationError(
                    f"TrainBatch.{name} must have one value per token; sequences {bad[:5]} differ"
                )
        if self.routed_experts is not None:
            bad = [i for i, (r, t) in enumerate(zip(self.routed_experts, lengths))
                   if r is not None and (r.dim() != 3 or r.shape[0] != t)]
            if len(self.routed_experts) != n or bad:
                raise TrajectoryValidationError(
                    f"TrainBatch.routed_experts needs one [tokens, layers, top_k] tensor (or "
                    f"None) per sequence; sequences {bad[:5]} (of {len(self.routed_experts)}) "
                    "do not match their token counts"
                )
        for name in ("group_ids", "rewards", "turn_rewards", "turn_ends"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise TrajectoryValidationError(
                    f"TrainBatch.{name} has {len(value)} entries for {n} sequences"
                )
        if any(t == 0 for t in lengths):
            raise TrajectoryValidationError("TrainBatch contains an empty sequence; drop it first")
        first = [i for i, m in enumerate(self.loss_mask) if m[0] != 0]
        if first:
            raise TrajectoryValidationError(
                f"the first token of sequences {first[:5]} has loss_mask 1, but the first token "
                "has no context to be predicted from; start every sequence with its prompt "
                "(prompt_len >= 1)"
            )
        if self.paired and n % 2:
            raise TrajectoryValidationError(
                f"a paired (DPO) batch needs an even number of sequences, got {n}"
            )

    # construction -----------------------------------------------------------------------
    @classmethod
    def from_samples(
        cls, samples: Sequence[Sample], *, advantages: Sequence[Any] | None = None
    ) -> TrainBatch:
        """Tokens, loss mask, rollout logprobs, rewards and groups of rollout samples.

        Advantages: per-token ``advantages`` if given, else each ``Sample.advantage`` spread
        over its loss tokens when every sample has one, else none (``compute_advantages``).
        """
        if not samples:
            raise TrajectoryValidationError("cannot build a TrainBatch from zero samples")
        masks = [torch.tensor(s.loss_mask_T, dtype=torch.float32) for s in samples]
        adv: Any = advantages
        if adv is None and all(s.advantage is not None for s in samples):
            adv = [m * float(s.advantage or 0.0) for m, s in zip(masks, samples)]
        return cls(
            token_ids=_as_tensor_tuple((s.token_ids_T for s in samples), torch.long),
            loss_mask=tuple(masks),
            advantages=adv,
            rollout_logprobs=_as_tensor_tuple((s.logprobs_T for s in samples), torch.float32),
            group_ids=tuple(s.group_id for s in samples),
            rewards=torch.tensor([float(s.reward) for s in samples]),
            turn_rewards=tuple(tuple(float(r) for r in s.turn_rewards) for s in samples),
            turn_ends=tuple(tuple(int(e) for e in s.turn_ends) for s in samples),
            routed_experts=(tuple(s.routed_experts for s in samples)
                            if any(s.routed_experts is not None for s in samples) else None),
        )

    @classmethod
    def from_pairs(cls, chosen: Sequence[Sample], rejected: Sequence[Sample]) -> TrainBatch:
        """A DPO batch: sequences ``[c0, r0, c1, r1, ...]`` with their loss masks."""
        if len(chosen) != len(rejected) or not chosen:
            raise TrajectoryValidationError(
                f"DPO needs as many chosen as rejected samples (>0), got {len(chosen)} and "
                f"{len(rejected)}"
            )
        seqs = [s for pair in zip(chosen, rejected) for s in pair]
        return cls(
            token_ids=_as_tensor_tuple((s.token_ids_T for s in seqs), torch.long),
            loss_mask=_as_tensor_tuple((s.loss_mask_T for s in seqs), torch.float32),
            paired=True,
        )

    def replace(self, **changes: Any) -> TrainBatch:
        """A copy with some fields replaced (e.g. ``advantages=...``, ``ref_logprobs=...``)."""
        return dataclasses.replace(self, **changes)

    def select(self, indices: Sequence[int]) -> TrainBatch:
        """The sub-batch of the given sequences (PPO mini-batches); pairs must stay whole."""
        idx = list(indices)
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or f.name == "paired":
                continue
            changes[f.name] = value[idx] if isinstance(value, torch.Tensor) else [
                value[i] for i in idx
            ]
        return TrainBatch(**changes, paired=self.paired)

    # views -------------------------------------------------------------------------------
    @property
    def num_sequences(self) -> int:
        return len(self.token_ids)

    @property
    def lengths(self) -> list[int]:
        return [int(t.shape[0]) for t in self.token_ids]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def num_loss_tokens(self) -> int:
        return int(sum(float(m.sum()) for m in self.loss_mask))

    def group_index(self) -> torch.Tensor:
        """``long [N]`` group of each sequence (0..G-1); sequences without a group id are alone."""
        if self.group_ids is None:
            return torch.arange(self.num_sequences)
        index: dict[str, int] = {}
        out = []
        for i, g in enumerate(self.group_ids):
            key = g if g else f"\x00ungrouped-{i}"
            out.append(index.setdefault(key, len(index)))
        return torch.tensor(out, dtype=torch.long)

    def padded(self, name: str, pad_value: float = 0.0) -> torch.Tensor:
        """Field ``name`` (or ``token_ids``) right-padded into ``[N, T_max]``."""
        value = getattr(self, name)
        if value is None:
            raise ConfigError(f"TrainBatch.{name} is not set")
        return pad_ragged(value, pad_value)

    def units(self) -> list[list[int]]:
        """Groups of sequence indices that must share a micro-batch (DPO pairs)."""
        if self.paired:
            return [[i, i + 1] for i in range(0, self.num_sequences, 2)]
        return [[i] for i in range(self.num_sequences)]


__all__ = ["TOKEN_FIELDS", "TrainBatch", "pad_ragged", "unpad"]

"""Batches for the trainers: ``TrainBatch`` (ragged, one entry per sequence) and ``MicroBatch``.

A ``TrainBatch`` holds one 1-D tensor per sequence for the token ids and for every per-token
field (loss mask, advantages, old/reference/rollout logprobs, critic values and returns). All
per-token fields are aligned with the token positions: ``field[t]`` belongs to token ``t``, so a
logprob at ``t`` is ``log pi(token_t | tokens_<t)`` (the convention of ``Sample.logprobs_T``).
The first token of a sequence has no context and can never be trained on.

``make_micro_batches`` cuts a batch into token-balanced micro-batches of at most
``max_tokens`` tokens. Packed micro-batches put several sequences in one row with position ids
that restart at 0 for each sequence; Hugging Face models turn such position ids (with no
attention mask) into a block-diagonal causal mask, and flash attention into varlen kernels, so
no token attends across sequences. Unpacked micro-batches right-pad one sequence per row and
pass a 2-D attention mask (for attention implementations without packed-sequence support).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
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


@dataclass
class MicroBatch:
    """Padded/packed tensors of some sequences of a ``TrainBatch``, ready for a forward pass.

    ``indices[k]`` is the batch index of local sequence ``k``; ``spans[k] = (row, start,
    length)`` is where it lies; ``seq_index`` holds ``k`` at its tokens and -1 at padding.
    ``fields`` holds per-token float tensors (``[R, L]``, 0 at padding) and ``seq_fields``
    per-sequence tensors (``[k]``).
    """

    indices: list[int]
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    seq_index: torch.Tensor
    spans: list[tuple[int, int, int]]
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    seq_fields: dict[str, torch.Tensor] = field(default_factory=dict)
    #: MoE routing replay: ``[R, L, layers, top_k]`` int16 rollout experts, -1 = route freely
    routed_experts: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return sum(n for _, _, n in self.spans)

    @property
    def num_sequences(self) -> int:
        return len(self.indices)

    def to(self, device: torch.device | str) -> MicroBatch:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return MicroBatch(
            indices=self.indices,
            input_ids=move(self.input_ids),
            position_ids=move(self.position_ids),
            attention_mask=None if self.attention_mask is None else move(self.attention_mask),
            seq_index=move(self.seq_index),
            spans=self.spans,
            fields={k: move(v) for k, v in self.fields.items()},
            seq_fields={k: move(v) for k, v in self.seq_fields.items()},
            routed_experts=None if self.routed_experts is None else move(self.routed_experts),
        )

    def unpack(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Per-token ``[R, L]`` values back into one 1-D tensor per local sequence."""
        return [values[row, start : start + n] for row, start, n in self.spans]


def _units(units: Sequence[Sequence[int]] | None, n: int) -> list[list[int]]:
    return [list(u) for u in units] if units is not None else [[i] for i in range(n)]


def plan_micro_batches(
    lengths: Sequence[int],
    max_tokens: int,
    *,
    pack: bool = True,
    units: Sequence[Sequence[int]] | None = None,
) -> list[list[int]]:
    """Token-balanced bins of sequence indices, each costing at most ``max_tokens`` tokens.

    Packed, a bin costs the sum of its lengths (first-fit decreasing). Unpacked, it costs
    ``rows * longest`` (padding included), filled greedily from the longest sequence down. A
    unit (DPO pair) longer than ``max_tokens`` gets a bin of its own. Deterministic.
    """
    if max_tokens <= 0:
        raise ConfigError(f"max_tokens per micro-batch must be > 0, got {max_tokens}")
    unit_list = _units(units, len(lengths))
    size = [sum(lengths[i] for i in u) for u in unit_list]
    longest = [max(lengths[i] for i in u) for u in unit_list]
    order = sorted(range(len(unit_list)), key=lambda k: (-(size[k] if pack else longest[k]), k))
    bins: list[list[int]] = []
    if pack:
        loads: list[int] = []
        for k in order:
            for b, load in enumerate(loads):
                if load + size[k] <= max_tokens:
                    bins[b].extend(unit_list[k])
                    loads[b] += size[k]
                    break
            else:
                bins.append(list(unit_list[k]))
                loads.append(size[k])
    else:
        rows = 0
        width = 0
        for k in order:
            new_rows = rows + len(unit_list[k])
            new_width = max(width, longest[k])
            if bins and new_rows * new_width <= max_tokens:
                bins[-1].extend(unit_list[k])
                rows, width = new_rows, new_width
            else:
                bins.append(list(unit_list[k]))
                rows, width = len(unit_list[k]), longest[k]
    return [sorted(b) for b in bins]


def split_across_ranks(
    lengths: Sequence[int],
    world_size: int,
    *,
    units: Sequence[Sequence[int]] | None = None,
) -> list[list[int]]:
    """Assign sequences to data-parallel ranks with balanced token counts (greedy LPT)."""
    unit_list = _units(units, len(lengths))
    size = [sum(lengths[i] for i in u) for u in unit_list]
    loads = [0] * world_size
    parts: list[list[int]] = [[] for _ in range(world_size)]
    for k in sorted(range(len(unit_list)), key=lambda k: (-size[k], k)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        parts[rank].extend(unit_list[k])
        loads[rank] += size[k]
    return [sorted(p) for p in parts]


def build_micro_batch(
    token_ids: Sequence[torch.Tensor],
    indices: Sequence[int],
    *,
    pack: bool,
    fields: Mapping[str, Sequence[torch.Tensor]] | None = None,
    seq_fields: Mapping[str, torch.Tensor] | None = None,
    routed_experts: Sequence[torch.Tensor | None] | None = None,
) -> MicroBatch:
    """Tensors of the sequences ``indices``: one packed row, or one padded row per sequence."""
    fields = fields or {}
    lens = [int(token_ids[i].shape[0]) for i in indices]
    if pack:
        rows, width = 1, sum(lens)
        spans = []
        start = 0
        for n in lens:
            spans.append((0, start, n))
            start += n
    else:
        rows, width = len(indices), max(lens)
        spans = [(r, 0, n) for r, n in enumerate(lens)]
    input_ids = torch.zeros(rows, width, dtype=torch.long)
    position_ids = torch.zeros(rows, width, dtype=torch.long)
    seq_index = torch.full((rows, width), -1, dtype=torch.long)
    out_fields = {k: torch.zeros(rows, width, dtype=torch.float32) for k in fields}
    for k, (i, (row, start, n)) in enumerate(zip(indices, spans)):
        input_ids[row, start : start + n] = token_ids[i]
        position_ids[row, start : start + n] = torch.arange(n)
        seq_index[row, start : start + n] = k
        for name, values in fields.items():
            out_fields[name][row, start : start + n] = values[i]
    routes = None
    shapes = [] if routed_experts is None else [
        tuple(r.shape[1:]) for r in (routed_experts[i] for i in indices) if r is not None]
    if shapes:
        routes = torch.full((rows, width, *shapes[0]), -1, dtype=torch.int16)
        for i, (row, start, n) in zip(indices, spans):
            r = routed_experts[i]  # type: ignore[index]
            if r is not None:
                routes[row, start : start + n] = r.to(torch.int16)
    attention_mask = None
    if not pack:
        attention_mask = (seq_index >= 0).to(torch.long)
        # padding keeps counting positions so every row looks like one plain sequence
        position_ids = torch.arange(width).expand(rows, width).clone()
    return MicroBatch(
        indices=list(indices),
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        seq_index=seq_index,
        spans=spans,
        fields=out_fields,
        seq_fields={k: v[list(indices)] for k, v in (seq_fields or {}).items()},
        routed_experts=routes,
    )


def make_micro_batches(
    batch: TrainBatch,
    max_tokens: int,
    *,
    pack: bool = True,
    fields: Mapping[str, Sequence[torch.Tensor]] | None = None,
    seq_fields: Mapping[str, torch.Tensor] | None = None,
    subset: Sequence[int] | None = None,
) -> list[MicroBatch]:
    """Token-balanced micro-batches of ``batch`` (or of the sequences in ``subset``).

    ``fields`` are the per-token tensors to carry (default: every field set on the batch).
    """
    if fields is None:
        fields = {n: getattr(batch, n) for n in TOKEN_FIELDS if getattr(batch, n) is not None}
    chosen = list(range(batch.num_sequences)) if subset is None else list(subset)
    position = {g: k for k, g in enumerate(chosen)}
    lengths = [batch.lengths[i] for i in chosen]
    units = [[position[i] for i in u] for u in batch.units() if u[0] in position]
    plans = plan_micro_batches(lengths, max_tokens, pack=pack, units=units)
    return [
        build_micro_batch(
            batch.token_ids, [chosen[k] for k in plan], pack=pack, fields=fields,
            seq_fields=seq_fields, routed_experts=batch.routed_experts,
        )
        for plan in plans
    ]


__all__ = [
    "TOKEN_FIELDS",
    "MicroBatch",
    "TrainBatch",
    "build_micro_batch",
    "make_micro_batches",
    "pad_ragged",
    "plan_micro_batches",
    "split_across_ranks",
    "unpad",
]

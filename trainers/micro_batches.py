"""Token-balanced micro-batches of a `TrainBatch`: the plan (`plan_micro_batches`: packed rows
or padded ones, multi-sequence units kept whole), the data-parallel split (`split_across_ranks`)
and the tensors (`MicroBatch`: ids, positions, the loss's per-token fields).

``make_micro_batches`` cuts a batch into token-balanced micro-batches of at most
``max_tokens`` tokens. Packed micro-batches put several sequences in one row with position ids
that restart at 0 for each sequence; Hugging Face models turn such position ids (with no
attention mask) into a block-diagonal causal mask, and flash attention into varlen kernels, so
no token attends across sequences. Unpacked micro-batches right-pad one sequence per row and
pass a 2-D attention mask (for attention implementations without packed-sequence support).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from palaestra.errors import ConfigError
from palaestra.trainers.batching import TOKEN_FIELDS, TrainBatch


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


__all__ = ["MicroBatch", "build_micro_batch", "make_micro_batches", "plan_micro_batches", "split_across_ranks"]

"""From samples to training input: token-balanced data-parallel shards, micro-batches, tensors.

`balance_by_tokens` splits samples across data-parallel ranks so that every rank gets about the
same number of tokens (longest-processing-time greedy: the heaviest sample goes to the lightest
rank), which is what bounds the step time of the slowest rank. `micro_batches` packs each rank's
share into micro-batches under a token budget, with the same number of micro-batches on every
rank (ranks step their gradient accumulation in lockstep). `collate` pads a list of samples
into tensors (torch is imported only there).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

from palaestra.errors import ConfigError
from palaestra.types import Sample


def balance_by_tokens(samples: Sequence[Sample], n_ranks: int) -> list[list[Sample]]:
    """Split ``samples`` over ``n_ranks`` with near-equal token counts (order kept per rank)."""
    if n_ranks < 1:
        raise ConfigError(f"n_ranks must be >= 1, got {n_ranks}")
    return [[samples[i] for i in part] for part in _lpt([s.num_tokens for s in samples], n_ranks)]


def _lpt(weights: Sequence[int], n_bins: int) -> list[list[int]]:
    """Indices split into ``n_bins`` by longest-first greedy; each bin sorted by index."""
    heap = [(0, b) for b in range(n_bins)]
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + weights[i], b))
    return [sorted(b) for b in bins]


def micro_batches(
    samples: Sequence[Sample], n_ranks: int, max_tokens: int
) -> list[list[list[Sample]]]:
    """Per rank, micro-batches of at most ``max_tokens`` tokens (a longer sample gets its own).

    Every rank gets the same number of micro-batches: the count the fullest rank needs.
    """
    if max_tokens < 1:
        raise ConfigError(f"max_tokens must be >= 1, got {max_tokens}")
    shards = balance_by_tokens(samples, n_ranks)
    needed = max((_first_fit_count([s.num_tokens for s in shard], max_tokens) for shard in shards),
                 default=1)
    needed = max(needed, 1)
    out = []
    for shard in shards:
        parts = _lpt([s.num_tokens for s in shard], needed)
        out.append([[shard[i] for i in part] for part in parts])
    return out


def _first_fit_count(weights: Sequence[int], cap: int) -> int:
    loads: list[int] = []
    for w in sorted(weights, reverse=True):
        for j, load in enumerate(loads):
            if load + w <= cap:
                loads[j] += w
                break
        else:
            loads.append(w)
    return len(loads)


def collate(samples: Sequence[Sample], pad_id: int = 0) -> dict[str, Any]:
    """Right-padded tensors: input_ids, attention_mask, loss_mask, logprobs, versions, rewards,
    advantages (per sample; NaN where unset)."""
    import torch

    if not samples:
        raise ConfigError("collate needs at least one sample")
    width = max(s.num_tokens for s in samples)
    n = len(samples)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width), dtype=torch.float32)
    logprobs = torch.zeros((n, width), dtype=torch.float32)
    versions = torch.full((n, width), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        k = s.num_tokens
        input_ids[i, :k] = torch.tensor(s.token_ids_T, dtype=torch.long)
        attention[i, :k] = 1
        loss_mask[i, :k] = torch.tensor(s.loss_mask_T, dtype=torch.float32)
        logprobs[i, :k] = torch.tensor(s.logprobs_T, dtype=torch.float32)
        versions[i, :k] = torch.tensor(s.versions_T, dtype=torch.long)
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "loss_mask": loss_mask,
        "rollout_logprobs": logprobs,
        "versions": versions,
        "rewards": torch.tensor([s.reward for s in samples], dtype=torch.float32),
        "advantages": torch.tensor(
            [float("nan") if s.advantage is None else s.advantage for s in samples],
            dtype=torch.float32,
        ),
    }


__all__ = ["balance_by_tokens", "collate", "micro_batches"]

"""Prefix reuse for multi-turn generation: KV of finished requests, keyed by their token ids.

When a request finishes, the KV of every token it ran through the model (prompt + generated
tokens but the last) is kept here. A new request whose prompt starts with such a sequence (the
next turn of the same conversation, or another sample of the same prompt) copies that KV back and
prefills only the tokens after it. Entries are found through a bucket keyed by their first
``KEY_TOKENS`` tokens, then by the longest common prefix; the least recently used are evicted
past ``capacity_tokens``. A weight update flushes everything (the KV belongs to old weights).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

KEY_TOKENS = 16


@dataclass(eq=False)
class PrefixEntry:
    tokens: tuple[int, ...]
    kv: tuple[torch.Tensor, torch.Tensor]
    session_id: str | None = None

    def __len__(self) -> int:
        return len(self.tokens)


def common_prefix_len(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    n = min(len(a), len(b))
    if tuple(a[:n]) == tuple(b[:n]):
        return n
    lo, hi = 0, n  # binary search on slice equality: O(n log n) in C, not a Python loop over n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tuple(a[:mid]) == tuple(b[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixCache:
    """LRU store of `PrefixEntry` with longest-prefix lookup."""

    def __init__(self, capacity_tokens: int, min_tokens: int = KEY_TOKENS) -> None:
        self.capacity_tokens = capacity_tokens
        self.min_tokens = max(min_tokens, KEY_TOKENS)
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self._buckets: dict[tuple[int, ...], list[PrefixEntry]] = {}
        self.num_tokens = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._buckets.clear()
        self.num_tokens = 0

    def insert(self, tokens: tuple[int, ...], kv: tuple[Any, Any],
               session_id: str | None = None) -> bool:
        """Keep ``kv`` for ``tokens``; entries that are a prefix of it are dropped (superseded)."""
        if len(tokens) < self.min_tokens or len(tokens) > self.capacity_tokens:
            return False
        bucket = self._buckets.setdefault(tokens[:KEY_TOKENS], [])
        for old in list(bucket):
            if len(old) <= len(tokens) and tokens[: len(old)] == old.tokens:
                self._remove(old)
        entry = PrefixEntry(tokens, kv, session_id)
        self._buckets.setdefault(tokens[:KEY_TOKENS], []).append(entry)
        self._entries[id(entry)] = entry
        self.num_tokens += len(tokens)
        while self.num_tokens > self.capacity_tokens and self._entries:
            _, lru = next(iter(self._entries.items()))
            self._remove(lru)
        return True

    def match(self, tokens: list[int] | tuple[int, ...]) -> tuple[PrefixEntry | None, int]:
        """The entry sharing the longest prefix with ``tokens`` and that prefix's length."""
        if len(tokens) < self.min_tokens:
            return None, 0
        best, best_len = None, 0
        for entry in self._buckets.get(tuple(tokens[:KEY_TOKENS]), ()):
            n = common_prefix_len(entry.tokens, tokens)
            if n > best_len:
                best, best_len = entry, n
        if best is None or best_len < self.min_tokens:
            self.misses += 1
            return None, 0
        self.hits += 1
        self._entries.move_to_end(id(best))
        return best, best_len

    def _remove(self, entry: PrefixEntry) -> None:
        if self._entries.pop(id(entry), None) is None:
            return
        self.num_tokens -= len(entry)
        bucket = self._buckets.get(entry.tokens[:KEY_TOKENS])
        if bucket is not None:
            bucket.remove(entry)
            if not bucket:
                del self._buckets[entry.tokens[:KEY_TOKENS]]


__all__ = ["PrefixCache", "PrefixEntry", "common_prefix_len"]

"""Token drift: how far an agent's incremental token ids are from a full re-render.

The agent appends sampled tokens as the engine returned them and renders only environment
messages, so its ids are what the policy saw. A full re-render of the same messages can differ:
templates drop earlier reasoning, normalise whitespace or tool-call JSON, and a model may sample a
non-canonical tokenization. Training on the re-render would then train on tokens the policy never
produced; the drift report measures the gap.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from palaestra.errors import TokenDriftError


@dataclass(frozen=True)
class DriftReport:
    """Incremental ids vs a full re-render of the conversation.

    ``mismatches`` counts tokens outside a longest common subsequence (a dropped 12-token think
    block gives 12, not the length of everything after it); ``first_mismatch`` is the first
    differing index (None when identical).
    """

    mismatches: int
    first_mismatch: int | None
    num_tokens: int
    reference_tokens: int
    incremental_excerpt: str = ""
    reference_excerpt: str = ""

    @property
    def ok(self) -> bool:
        return self.mismatches == 0

    def message(self) -> str:
        if self.ok:
            return f"no token drift ({self.num_tokens} tokens)"
        return (
            f"token drift: {self.mismatches} tokens differ from a full re-render "
            f"({self.num_tokens} incremental vs {self.reference_tokens} re-rendered), first at "
            f"index {self.first_mismatch}: incremental {self.incremental_excerpt!r} vs "
            f"re-render {self.reference_excerpt!r}"
        )

    def raise_if_drift(self) -> None:
        if not self.ok:
            raise TokenDriftError(
                self.message() + ". Train on the incremental ids (the agent's Sample), or fix "
                "the renderer/template if the two should agree."
            )


def compare_ids(
    incremental: Sequence[int],
    reference: Sequence[int],
    decode: Callable[[Sequence[int]], str] | None = None,
    *,
    separators: Collection[int] = (),
    window: int = 8,
) -> DriftReport:
    """Compare two token sequences; ``decode`` (optional) fills the excerpts around the drift.

    ``separators`` (e.g. the id of ``<|im_start|>``) split both sequences into messages; when both
    have the same number of messages they are compared message by message, which keeps the cost
    linear in the length and proportional to the drift itself.
    """
    a, b = list(incremental), list(reference)
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    if first is None:
        return DriftReport(0, None, len(a), len(b))
    pieces_a, pieces_b = _split(a, separators), _split(b, separators)
    if len(pieces_a) == len(pieces_b):
        pairs = zip(pieces_a, pieces_b, strict=True)
        mismatches = sum(_mismatches(x, y) for x, y in pairs if x != y)
    else:
        mismatches = _mismatches(a, b)
    excerpts = ("", "")
    if decode is not None:
        lo = max(0, first - window)
        excerpts = (decode(a[lo : first + window]), decode(b[lo : first + window]))
    return DriftReport(mismatches, first, len(a), len(b), *excerpts)


def _split(ids: list[int], separators: Collection[int]) -> list[list[int]]:
    if not separators:
        return [ids]
    pieces: list[list[int]] = [[]]
    for token in ids:
        if token in separators and pieces[-1]:
            pieces.append([])
        pieces[-1].append(token)
    return pieces


def _mismatches(a: list[int], b: list[int], max_edits: int = 1024) -> int:
    """Tokens outside a longest common subsequence: ``max(len) - LCS``.

    Common ends are trimmed first; the middle goes to Myers' O(ND) difference algorithm. Past
    ``max_edits`` insertions+deletions the whole middle counts (an upper bound).
    """
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    x, y = a[head : len(a) - tail], b[head : len(b) - tail]
    d = _edit_distance(x, y, max_edits)
    if d is None:
        return max(len(x), len(y))
    lcs = (len(x) + len(y) - d) // 2
    return max(len(x), len(y)) - lcs


def _edit_distance(a: list[int], b: list[int], max_d: int) -> int | None:
    """Insert/delete distance by Myers' greedy algorithm (1986); None past ``max_d``."""
    n, m = len(a), len(b)
    if n == 0 or m == 0:
        return n + m if n + m <= max_d else None
    offset = max_d + 1
    furthest = [0] * (2 * max_d + 3)  # furthest x reached on each diagonal k = x - y
    for d in range(max_d + 1):
        for k in range(-d, d + 1, 2):
            if k == -d or (k != d and furthest[offset + k - 1] < furthest[offset + k + 1]):
                x = furthest[offset + k + 1]  # step down (insertion)
            else:
                x = furthest[offset + k - 1] + 1  # step right (deletion)
            y = x - k
            while x < n and y < m and a[x] == b[y]:
                x += 1
                y += 1
            furthest[offset + k] = x
            if x >= n and y >= m:
                return d
    return None


__all__ = ["DriftReport", "compare_ids"]

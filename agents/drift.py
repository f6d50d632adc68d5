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


def _mismatches(a: list[int], b: list[int]) -> int:
    """Tokens outside a longest common subsequence: ``max(len) - LCS``.

    Common ends are trimmed first; the middle's LCS length comes from the bit-parallel
    algorithm (`_lcs_length`), exact at any distance. (Myers' O(ND) walk in Python took
    ~16 ms per check on a random-init model's replies, on the event loop that feeds the engine.)
    """
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    x, y = a[head : len(a) - tail], b[head : len(b) - tail]
    return max(len(x), len(y)) - _lcs_length(x, y)


def _lcs_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of a longest common subsequence, by bit-parallel dynamic programming.

    Allison-Dix / Hyyro (2004): the DP row over ``b`` is one integer ``v`` whose zero bits mark
    the columns where the LCS grows; each token of ``a`` updates it with one add, one subtract
    and three bit operations, so the cost is ``len(a)`` big-integer steps of ``len(b)`` bits,
    not ``len(a) * len(b)`` Python steps.
    """
    if not a or not b:
        return 0
    masks: dict[int, int] = {}
    for i, token in enumerate(b):
        masks[token] = masks.get(token, 0) | (1 << i)
    full = (1 << len(b)) - 1
    v = full
    for token in a:
        u = v & masks.get(token, 0)
        v = ((v + u) | (v - u)) & full
    return len(b) - v.bit_count()


__all__ = ["DriftReport", "compare_ids"]

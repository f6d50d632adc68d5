"""The drift check's LCS length equals the textbook dynamic programme."""

from __future__ import annotations

import random

from palaestra.agents.drift import _lcs_length, _mismatches


def _lcs_dp(a: list[int], b: list[int]) -> int:
    row = [0] * (len(b) + 1)
    for x in a:
        prev_diag = 0
        for j, y in enumerate(b, 1):
            keep = row[j]
            row[j] = prev_diag + 1 if x == y else max(row[j], row[j - 1])
            prev_diag = keep
    return row[-1]


def test_lcs_length_equals_the_dp_on_random_sequences() -> None:
    rng = random.Random(0)
    for _ in range(300):
        alphabet = rng.choice((2, 5, 50))
        a = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 90))]
        b = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 90))]
        assert _lcs_length(a, b) == _lcs_dp(a, b), (a, b)


def test_mismatches_count_tokens_outside_the_lcs() -> None:
    base = list(range(100, 160))
    dropped = base[:20] + base[32:]  # a 12-token block dropped from the middle
    assert _mismatches(base, dropped) == 12
    assert _mismatches(base, base) == 0
    swapped = base[:10] + [1, 2, 3] + base[10:]
    assert _mismatches(base, swapped) == 3
    assert _mismatches([], [7, 8]) == 2
    far = list(range(2000))  # far apart: exact, with no edit bound
    assert _mismatches(far, far[::-1]) == 1999

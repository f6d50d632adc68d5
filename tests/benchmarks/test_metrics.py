"""pass@k, maj@k and their aggregation against independent computations."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from fractions import Fraction

import pytest

from palaestra.benchmarks.metrics import (
    aggregate,
    bootstrap_ci,
    maj_at_k,
    majority_correct,
    pass_at_k,
    task_metrics,
)


def closed_form(n: int, c: int, k: int) -> Fraction:
    """1 - C(n-c, k) / C(n, k), exactly, with Python's big integers."""
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def brute_force(n: int, c: int, k: int) -> Fraction:
    """The fraction of k-subsets of the n samples that contain at least one correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    return Fraction(sum(any(s) for s in subsets), len(subsets))


def test_pass_at_k_matches_closed_form_on_random_cases():
    rng = random.Random(1234)
    for _ in range(2000):
        n = rng.randint(1, 400)
        c = rng.randint(0, n)
        k = rng.randint(1, n)
        assert pass_at_k(n, c, k) == pytest.approx(float(closed_form(n, c, k)), abs=1e-12)


def test_pass_at_k_matches_brute_force_for_small_n():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(brute_force(n, c, k)), abs=1e-12)


def test_pass_at_k_is_stable_where_binomials_overflow_floats():
    # C(5000, 2500) is ~1e1503: a float formula would overflow; the product form must not.
    value = pass_at_k(5000, 3, 2500)
    assert math.isfinite(value)
    assert value == pytest.approx(float(closed_form(5000, 3, 2500)), rel=1e-12)
    assert pass_at_k(5000, 0, 2500) == 0.0
    assert pass_at_k(5000, 2501, 2500) == 1.0


def test_pass_at_k_basic_identities():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the fraction correct
    assert pass_at_k(10, 3, 10) == 1.0
    assert pass_at_k(10, 0, 5) == 0.0
    for n, c in [(16, 5), (7, 2), (100, 1)]:  # pass@k never decreases in k
        values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
        assert all(a <= b + 1e-15 for a, b in zip(values, values[1:]))


@pytest.mark.parametrize("n,c,k", [(0, 0, 1), (3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)])
def test_pass_at_k_rejects_impossible_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def brute_majority(answers, correct, k):
    """Expected majority-vote correctness over all k-subsets with uniform tie-breaking."""
    total = Fraction(0)
    subsets = list(itertools.combinations(range(len(answers)), k))
    for subset in subsets:
        votes = Counter(answers[i] for i in subset if answers[i] is not None)
        if not votes:
            continue
        top = max(votes.values())
        winners = [a for a, v in votes.items() if v == top]
        right = {answers[i] for i in subset if correct[i]}
        total += Fraction(sum(w in right for w in winners), len(winners))
    return total / len(subsets)


def test_maj_at_k_matches_brute_force():
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 7)
        gold = "42"
        answers = [rng.choice(["42", "41", "40", None]) for _ in range(n)]
        correct = [a == gold for a in answers]
        for k in range(1, n + 1):
            expected = brute_majority(answers, correct, k)
            assert maj_at_k(answers, correct, k) == pytest.approx(float(expected), abs=1e-12)


def test_majority_vote_examples():
    assert majority_correct(["1", "1", "2"], [True, True, False]) == 1.0
    assert majority_correct(["1", "2", "2"], [True, False, False]) == 0.0
    assert majority_correct(["1", "2"], [True, False]) == 0.5  # a tie
    assert majority_correct([None, None], [False, False]) == 0.0
    assert maj_at_k(["1", "2", "2"], [True, False, False], 3) == 0.0
    # maj@n can beat pass@1 and lose to pass@n
    answers, correct = ["7", "7", "7", "3", "5"], [True, True, True, False, False]
    assert maj_at_k(answers, correct, 5) == 1.0


def test_maj_at_k_monte_carlo_is_seeded_and_close():
    rng = random.Random(3)
    answers = [rng.choice("abc") for _ in range(30)]
    correct = [a == "a" for a in answers]
    first = maj_at_k(answers, correct, 15, seed=1)
    assert first == maj_at_k(answers, correct, 15, seed=1)  # C(30, 15) subsets: sampled
    share = answers.count("a") / 30
    assert 0.0 <= first <= 1.0
    if share > 0.5:
        assert first > 0.5


def test_task_metrics_and_aggregate():
    m = task_metrics([True, False, False, True], [1.0, 0.0, 0.0, 1.0], ["3", "4", "4", "3"])
    assert m["pass@1"] == pytest.approx(0.5)
    assert m["pass@4"] == 1.0
    assert m["mean@4"] == 0.5
    assert m["mean_reward"] == 0.5
    assert set(k for k in m if k.startswith("maj@")) == {"maj@1", "maj@2", "maj@3", "maj@4"}
    agg = aggregate([{"pass@1": 1.0, "pass@2": 1.0}, {"pass@1": 0.0}])
    assert agg == {"pass@1": 0.5, "pass@2": 1.0}


def test_bootstrap_interval_covers_the_mean():
    values = [1.0] * 30 + [0.0] * 70
    low, high = bootstrap_ci(values, seed=0)
    assert low < 0.3 < high
    assert (low, high) == bootstrap_ci(values, seed=0)
    assert bootstrap_ci([1.0, 1.0, 1.0]) == (1.0, 1.0)

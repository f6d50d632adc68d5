"""Metrics over n samples per task: unbiased pass@k, mean@k and maj@k, and their averages.

- ``pass@k``: the probability that at least one of k samples drawn without replacement from the n
  generated is correct, estimated without bias from c correct out of n (Chen et al. 2021, "Evaluating
  Large Language Models Trained on Code"): ``1 - C(n-c, k) / C(n, k)``, computed as the product
  ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``, which never forms the huge binomials.
- ``mean@k``: the expected fraction of correct samples among k; unbiased for every k it is c/n, so
  the harness reports it once, as ``mean@n``.
- ``maj@k``: the expected correctness of a majority vote over k samples (answers compared after the
  benchmark's normalisation; samples without an answer do not vote; ties are broken uniformly at
  random, so a tie contributes the fraction of tied answers that are correct). Exact by enumerating
  the k-subsets when there are at most `MAJ_EXACT_LIMIT` of them, otherwise a seeded Monte Carlo
  estimate over `MAJ_DRAWS` subsets.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence

MAJ_EXACT_LIMIT = 5000
MAJ_DRAWS = 2000


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task with ``c`` correct samples out of ``n`` (needs k <= n)."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def majority_correct(answers: Sequence[Hashable | None], correct: Sequence[bool]) -> float:
    """Expected correctness of a majority vote (uniform tie-break) over these samples."""
    votes: Counter[Hashable] = Counter(a for a in answers if a is not None)
    if not votes:
        return 0.0
    right: dict[Hashable, list[bool]] = {}
    for answer, ok in zip(answers, correct):
        if answer is not None:
            right.setdefault(answer, []).append(bool(ok))
    top = max(votes.values())
    winners = [a for a, count in votes.items() if count == top]
    # an answer is correct when most of the samples that gave it were scored correct (they agree
    # unless the scorer looks beyond the normalised answer)
    return sum(sum(right[a]) * 2 > len(right[a]) for a in winners) / len(winners)


def maj_at_k(
    answers: Sequence[Hashable | None], correct: Sequence[bool], k: int, *, seed: int = 0
) -> float:
    """Expected majority-vote correctness over k of the n samples (exact or seeded Monte Carlo)."""
    n = len(answers)
    if len(correct) != n:
        raise ValueError(f"{n} answers but {len(correct)} correctness flags")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if math.comb(n, k) <= MAJ_EXACT_LIMIT:
        subsets = list(itertools.combinations(range(n), k))
    else:
        rng = random.Random(seed)
        subsets = [tuple(rng.sample(range(n), k)) for _ in range(MAJ_DRAWS)]
    total = 0.0
    for subset in subsets:
        total += majority_correct([answers[i] for i in subset], [correct[i] for i in subset])
    return total / len(subsets)


def task_metrics(
    correct: Sequence[bool],
    rewards: Sequence[float],
    answers: Sequence[Hashable | None] | None = None,
) -> dict[str, float]:
    """pass@k and (when answers are given) maj@k for every k <= n, mean@n and mean reward."""
    n = len(correct)
    if n == 0:
        raise ValueError("a task needs at least one sample")
    c = sum(bool(x) for x in correct)
    out = {f"pass@{k}": pass_at_k(n, c, k) for k in range(1, n + 1)}
    out[f"mean@{n}"] = c / n
    out["mean_reward"] = sum(rewards) / n
    if answers is not None:
        for k in range(1, n + 1):
            out[f"maj@{k}"] = maj_at_k(answers, correct, k)
    return out


def aggregate(per_task: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Average each metric over the tasks that report it (tasks may differ in n)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for metrics in per_task:
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1
    return {key: sums[key] / counts[key] for key in sums}


def bootstrap_ci(
    values: Sequence[float], *, draws: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the mean of ``values`` (resampling items)."""
    import numpy as np

    data = np.asarray(values, dtype=float)
    if data.size == 0:
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, data.size, size=(draws, data.size))].mean(axis=1)
    alpha = (1.0 - level) / 2
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return (float(low), float(high))


__all__ = [
    "aggregate",
    "bootstrap_ci",
    "maj_at_k",
    "majority_correct",
    "pass_at_k",
    "task_metrics",
]

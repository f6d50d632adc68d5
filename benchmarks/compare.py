"""``palaestra eval compare RUN_A RUN_B``: per-benchmark deltas, bootstrap intervals, flipped tasks.

Both runs are read from their ``samples.jsonl``. On the tasks the two runs share, each task's score
is its accuracy (correct samples / samples); the delta of the means gets a paired percentile
bootstrap interval (tasks resampled with replacement, the same draw for both runs), and each run's
own mean gets its own interval. A task *flips* when it is solved (accuracy >= 0.5: the majority of
its samples correct) in one run and not in the other.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from palaestra.benchmarks.store import SAMPLES, read_records
from palaestra.benchmarks.summary import TaskOutcome, group_tasks
from palaestra.errors import ConfigError

SOLVED = 0.5


@dataclass(frozen=True)
class BenchmarkComparison:
    benchmark: str
    tasks: int  # tasks present in both runs
    a: float
    b: float
    delta: float
    a_ci: tuple[float, float]
    b_ci: tuple[float, float]
    delta_ci: tuple[float, float]
    gained: list[str] = field(default_factory=list)  # solved in B, not in A
    lost: list[str] = field(default_factory=list)  # solved in A, not in B
    only_a: int = 0
    only_b: int = 0

    @property
    def significant(self) -> bool:
        low, high = self.delta_ci
        return low > 0 or high < 0


def load_run(run_dir: str | Path, model: str | None = None) -> dict[str, dict[str, TaskOutcome]]:
    """benchmark -> task id -> outcome of one model in a run directory."""
    path = Path(run_dir) / SAMPLES
    if not path.exists():
        raise ConfigError(f"{run_dir} has no {SAMPLES}; pass the --out folder of a `palaestra eval` run")
    records = list(read_records(path))
    models = sorted({str(r["model"]) for r in records})
    if model is None:
        if len(models) > 1:
            raise ConfigError(
                f"{run_dir} holds samples of several models ({', '.join(models)}); choose one "
                "with --model-a/--model-b"
            )
    elif model not in models:
        raise ConfigError(f"{run_dir} has no samples of model {model!r}; it has {models}")
    by_bench: dict[str, list[Mapping[str, Any]]] = {}
    for record in records:
        if model is None or record["model"] == model:
            by_bench.setdefault(str(record["benchmark"]), []).append(record)
    return {name: group_tasks(rows) for name, rows in by_bench.items()}


def _paired_bootstrap(
    a: list[float], b: list[float], draws: int, seed: int
) -> tuple[tuple[float, float], tuple[float, float], tuple[float, float]]:
    import numpy as np

    if not a:
        nan = (math.nan, math.nan)
        return nan, nan, nan
    xa, xb = np.asarray(a), np.asarray(b)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(a), size=(draws, len(a)))
    ma, mb = xa[idx].mean(axis=1), xb[idx].mean(axis=1)

    def ci(values: Any) -> tuple[float, float]:
        low, high = np.quantile(values, [0.025, 0.975])
        return (float(low), float(high))

    return ci(ma), ci(mb), ci(mb - ma)


def compare_runs(
    run_a: str | Path,
    run_b: str | Path,
    *,
    model_a: str | None = None,
    model_b: str | None = None,
    draws: int = 2000,
    seed: int = 0,
) -> list[BenchmarkComparison]:
    a_runs, b_runs = load_run(run_a, model_a), load_run(run_b, model_b)
    out = []
    for name in sorted(set(a_runs) & set(b_runs)):
        ta, tb = a_runs[name], b_runs[name]
        shared = sorted(set(ta) & set(tb))
        sa = [ta[t].accuracy for t in shared]
        sb = [tb[t].accuracy for t in shared]
        a_ci, b_ci, d_ci = _paired_bootstrap(sa, sb, draws, seed)
        mean_a = sum(sa) / len(sa) if sa else math.nan
        mean_b = sum(sb) / len(sb) if sb else math.nan
        out.append(
            BenchmarkComparison(
                benchmark=name,
                tasks=len(shared),
                a=mean_a,
                b=mean_b,
                delta=mean_b - mean_a,
                a_ci=a_ci,
                b_ci=b_ci,
                delta_ci=d_ci,
                gained=[t for t in shared if tb[t].accuracy >= SOLVED > ta[t].accuracy],
                lost=[t for t in shared if ta[t].accuracy >= SOLVED > tb[t].accuracy],
                only_a=len(set(ta) - set(tb)),
                only_b=len(set(tb) - set(ta)),
            )
        )
    if not out:
        raise ConfigError(
            f"{run_a} and {run_b} share no benchmark (A: {sorted(a_runs)}, B: {sorted(b_runs)})"
        )
    return out


def format_comparison(rows: list[BenchmarkComparison], show_tasks: int = 10) -> str:
    lines = [
        "| benchmark | tasks | A | B | B - A | 95% CI of B - A | gained | lost |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        mark = " *" if r.significant else ""
        lines.append(
            f"| {r.benchmark} | {r.tasks} | {r.a:.4f} [{r.a_ci[0]:.3f}, {r.a_ci[1]:.3f}] | "
            f"{r.b:.4f} [{r.b_ci[0]:.3f}, {r.b_ci[1]:.3f}] | {r.delta:+.4f}{mark} | "
            f"[{r.delta_ci[0]:+.4f}, {r.delta_ci[1]:+.4f}] | {len(r.gained)} | {len(r.lost)} |"
        )
    lines.append("")
    lines.append("Scores are mean per-task accuracy on the shared tasks; * = the 95% CI excludes 0.")
    for r in rows:
        if r.only_a or r.only_b:
            lines.append(f"{r.benchmark}: {r.only_a} tasks only in A, {r.only_b} only in B (ignored)")
        for label, tasks in (("gained (solved only in B)", r.gained), ("lost (solved only in A)", r.lost)):
            if tasks:
                shown = ", ".join(tasks[:show_tasks]) + (" ..." if len(tasks) > show_tasks else "")
                lines.append(f"{r.benchmark} {label}: {shown}")
    return "\n".join(lines)


def comparison_json(rows: list[BenchmarkComparison]) -> str:
    return json.dumps({r.benchmark: asdict(r) for r in rows}, indent=2)


__all__ = ["BenchmarkComparison", "compare_runs", "comparison_json", "format_comparison", "load_run"]

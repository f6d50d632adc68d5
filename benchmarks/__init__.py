"""Evaluation: benchmarks (dataset + env + prompt + metrics), ``palaestra eval``, reports, compare.

Light to import: the registry, the metrics and `evaluate`'s settings load nothing heavy; engines,
agents, torch and matplotlib are imported by the functions that use them.

    from palaestra.benchmarks import Benchmark, register_benchmark, evaluate, EvalSettings

Performance benchmarks of the framework itself live in ``benchmarks/perf/`` (scripts, not part of
this package's API).
"""

from __future__ import annotations

from palaestra.benchmarks.metrics import maj_at_k, pass_at_k, task_metrics
from palaestra.benchmarks.registry import (
    get_benchmark,
    list_benchmarks,
    load_tasks,
    register_benchmark,
    unregister_benchmark,
)
from palaestra.benchmarks.spec import Benchmark

__all__ = [
    "Benchmark",
    "get_benchmark",
    "list_benchmarks",
    "load_tasks",
    "maj_at_k",
    "pass_at_k",
    "register_benchmark",
    "task_metrics",
    "unregister_benchmark",
]

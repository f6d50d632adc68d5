"""Evaluation: benchmarks (dataset + env + prompt + metrics), ``palaestra eval``, reports, compare.

Light to import: the registry, the metrics and `evaluate`'s settings load nothing heavy; engines,
agents, torch and matplotlib are imported by the functions that use them.

    from palaestra.benchmarks import Benchmark, register_benchmark, evaluate, EvalSettings

Performance benchmarks of the framework itself live in ``benchmarks/perf/`` (scripts, not part of
this package's API).
"""

from typing import TYPE_CHECKING

from palaestra.benchmarks.metrics import maj_at_k, pass_at_k, task_metrics
from palaestra.benchmarks.registry import (
    get_benchmark,
    list_benchmarks,
    load_tasks,
    register_benchmark,
    unregister_benchmark,
)
from palaestra.benchmarks.spec import Benchmark

if TYPE_CHECKING:  # the lazy exports for type checkers; at run time `__getattr__` loads them
    from palaestra.benchmarks.runner import EvalSettings as EvalSettings
    from palaestra.benchmarks.runner import evaluate as evaluate
    from palaestra.benchmarks.training import TrainingEvaluator as TrainingEvaluator

__all__ = [
    "Benchmark",
    "EvalSettings",
    "TrainingEvaluator",
    "evaluate",
    "get_benchmark",
    "list_benchmarks",
    "load_tasks",
    "maj_at_k",
    "pass_at_k",
    "register_benchmark",
    "task_metrics",
    "unregister_benchmark",
]


def __getattr__(name: str) -> object:
    # `evaluate` pulls in the rollout and env packages; load them only when asked for.
    if name in ("evaluate", "EvalSettings"):
        from palaestra.benchmarks import runner

        return getattr(runner, name)
    if name == "TrainingEvaluator":
        from palaestra.benchmarks.training import TrainingEvaluator

        return TrainingEvaluator
    raise AttributeError(f"module 'palaestra.benchmarks' has no attribute {name!r}")

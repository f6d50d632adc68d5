"""From sample records to per-task outcomes and the per-benchmark summary (``summary.json``)."""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from palaestra.benchmarks.metrics import aggregate, task_metrics

SUMMARY = "summary.json"


@dataclass(frozen=True)
class TaskOutcome:
    """The samples of one task, ordered by sample index."""

    task_id: str
    correct: tuple[bool, ...]
    rewards: tuple[float, ...]
    answers: tuple[str | None, ...]

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct)


def group_tasks(records: Iterable[Mapping[str, Any]]) -> dict[str, TaskOutcome]:
    """Task id -> outcome, from the records of one benchmark and one model."""
    by_task: dict[str, list[Mapping[str, Any]]] = {}
    for record in records:
        by_task.setdefault(str(record["task_id"]), []).append(record)
    out = {}
    for task_id, rows in by_task.items():
        rows.sort(key=lambda r: int(r["sample"]))
        out[task_id] = TaskOutcome(
            task_id=task_id,
            correct=tuple(bool(r["correct"]) for r in rows),
            rewards=tuple(float(r["reward"]) for r in rows),
            answers=tuple(r.get("answer") for r in rows),
        )
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def summarize(records: Sequence[Mapping[str, Any]], *, with_maj: bool) -> dict[str, Any]:
    """Metrics of one benchmark: pass@k and maj@k for every k <= n, means, stop reasons, cost."""
    tasks = group_tasks(records)
    per_task = [
        task_metrics(t.correct, t.rewards, t.answers if with_maj else None) for t in tasks.values()
    ]
    metrics = aggregate(per_task)
    n = max((len(t.correct) for t in tasks.values()), default=0)
    ordered: dict[str, Any] = {}
    for prefix in ("pass", "maj"):
        for k in range(1, n + 1):
            if f"{prefix}@{k}" in metrics:
                ordered[f"{prefix}@{k}"] = metrics[f"{prefix}@{k}"]
    if n:
        ordered["pass@k"] = metrics.get(f"pass@{n}", math.nan)
        ordered[f"mean@{n}"] = _mean([t.accuracy for t in tasks.values()])
    ordered["mean"] = metrics.get("mean_reward", math.nan)
    ordered["accuracy"] = _mean([float(c) for t in tasks.values() for c in t.correct])
    ordered["n"] = n
    ordered["tasks"] = len(tasks)
    ordered["samples"] = len(records)
    ordered["stop_reasons"] = dict(Counter(str(r.get("stop_reason")) for r in records))
    ordered["errors"] = sum(1 for r in records if r.get("error"))
    ordered["mean_completion_tokens"] = _mean([float(r.get("completion_tokens", 0)) for r in records])
    ordered["mean_turns"] = _mean([float(r.get("turns", 0)) for r in records])
    ordered["mean_time_s"] = _mean([float(r.get("time_s", 0.0)) for r in records])
    calls = [int(r.get("tool_calls", 0)) for r in records]
    ordered["mean_tool_calls"] = _mean([float(c) for c in calls])
    ordered["tool_call_rate"] = _mean([float(c > 0) for c in calls])  # >= 1 call (a search)
    ordered["env_metrics"] = _env_metric_means(records)
    models = sorted({str(r["model"]) for r in records})
    ordered["model"] = models[0] if len(models) == 1 else models
    return ordered


def _env_metric_means(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Mean of each number the env reported (``env_metrics``), over the records that have it."""
    values: dict[str, list[float]] = {}
    for record in records:
        for key, value in (record.get("env_metrics") or {}).items():
            values.setdefault(str(key), []).append(float(value))
    return {key: _mean(vs) for key, vs in sorted(values.items())}


def write_summary(out_dir: str | Path, summary: Mapping[str, Any]) -> Path:
    """Write ``summary.json`` atomically, keeping the entries of benchmarks not in ``summary``."""
    path = Path(out_dir) / SUMMARY
    merged: dict[str, Any] = {}
    if path.exists():
        try:
            merged = dict(json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError, ValueError):
            merged = {}
    merged.update(summary)
    summary = merged
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_clean(summary), indent=2, allow_nan=False, default=str) + "\n")
    os.replace(tmp, path)
    return path


def _clean(value: Any) -> Any:
    """NaN and infinities become null, so the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


__all__ = ["SUMMARY", "TaskOutcome", "group_tasks", "summarize", "write_summary"]

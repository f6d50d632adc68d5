"""The wall time of each phase of a run (``init eval``, ``sft``, ``rl``, ``evals``, ...),
printed at its end and kept in ``timing.json``.

`train_async` installs one `Phases` for the run; code anywhere below it marks a phase with
``with phase("name"):`` (nothing is timed outside a run). A phase nested in another is not
counted twice: step evaluations inside RL count as evals.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path


class Phases:
    """Wall time per phase; a phase nested in another is not counted twice (step evaluations
    inside RL count as evals)."""

    def __init__(self) -> None:
        self.began = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self._stack: list[list[float]] = []  # [start, time of nested phases]

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        frame = [time.perf_counter(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            spent = time.perf_counter() - frame[0]
            self.seconds[name] = self.seconds.get(name, 0.0) + spent - frame[1]
            if self._stack:
                self._stack[-1][1] += spent

    def summary(self) -> dict[str, float]:
        total = time.perf_counter() - self.began
        out = {"total": total, **self.seconds}
        out["setup and other"] = max(0.0, total - sum(self.seconds.values()))
        return {k: round(v, 2) for k, v in out.items()}


_CURRENT: ContextVar[Phases | None] = ContextVar("palaestra_phases", default=None)


@contextmanager
def phase(name: str) -> Iterator[None]:
    phases = _CURRENT.get()
    if phases is None:
        yield
        return
    with phases.time(name):
        yield


def report_time(run_root: Path, phases: Phases) -> None:
    times = phases.summary()
    (run_root / "timing.json").write_text(json.dumps(times, indent=2))
    parts = ", ".join(f"{k} {_duration(v)}" for k, v in times.items() if k != "total" and v > 0)
    print(f"[done] total {_duration(times['total'])} ({parts})", flush=True)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, sec = divmod(round(seconds), 60)
    return f"{minutes} min {sec:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


@contextmanager
def installed(phases: Phases) -> Iterator[Phases]:
    """``phases`` is the clock `phase` marks in this context (the run's)."""
    token = _CURRENT.set(phases)
    try:
        yield phases
    finally:
        _CURRENT.reset(token)


__all__ = ["Phases", "installed", "phase", "report_time"]

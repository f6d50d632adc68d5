"""Where a step's GPU idle time goes: a profiler trace's kernel timeline against named host ranges.

`trace_step` profiles one RL step of ``palaestra train`` (the loop benchmark's ``--trace``): a
``torch.profiler`` trace (CPU activity, and CUDA activity on a GPU: CUPTI's kernel, memcpy and
memset timeline of the whole process) while `palaestra.trace_ranges` records the host ranges the
code marks with a cause (tokenization, admission and stop checks, HTTP, weight sync, optimizer,
trainer data, the engine's step, the trainer's forward/backward, env and agent), on every thread.

`attribute` cuts the step into the instants the GPU ran something and the instants it did not,
and gives each idle instant to the finest cause active then (`palaestra.trace_ranges.CAUSES`
order), or to ``other`` (host code no range names: the rollout manager, the event loop, GIL
waits). The idle seconds by cause sum to the step's idle seconds, and busy + idle is the step's
measured time. Without a GPU (or CUDA activity) there is no kernel timeline: the whole step is
host time, attributed the same way (on CPU the model's compute is host time too:
``engine_step`` and ``train_compute``).

Served engines (``engine.kind = "sglang"``) compute in another process: their kernels are not in
this process's trace and their scheduler's ranges not in its recorder, so a served cell's
attribution is the trainer process's view (its HTTP round trips as ``http_serialization``).
"""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

#: trace event categories that occupy the GPU
GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
STEP_MARK = "palaestra/step"


def union(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Disjoint sorted intervals covering the same instants."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def attribute(window: tuple[int, int], busy: Sequence[tuple[int, int]],
              ranges: Iterable[tuple[str, int, int, int]],
              causes: Sequence[str]) -> dict[str, Any]:
    """Seconds of ``window`` (ns) the GPU was busy and idle, and the idle seconds by cause.

    ``busy``: GPU intervals (ns, any order, may overlap); ``ranges``: ``(cause, start, end,
    thread)``; ``causes``: finest first. Each idle instant goes to the first cause of ``causes``
    with a range open then, else to ``other``.
    """
    lo, hi = window
    rank = {c: i for i, c in enumerate(causes)}
    events: list[tuple[int, int, int]] = []  # (time, delta, slot): slot len(causes) = GPU
    for start, end in union(busy):
        start, end = max(start, lo), min(end, hi)
        if end > start:
            events += [(start, 1, len(causes)), (end, -1, len(causes))]
    ranged = {c: 0 for c in causes}
    for cause, start, end, _ in ranges:
        if cause not in rank:
            continue
        start, end = max(start, lo), min(end, hi)
        if end > start:
            events += [(start, 1, rank[cause]), (end, -1, rank[cause])]
            ranged[cause] += end - start
    events.sort()
    open_ = [0] * (len(causes) + 1)
    idle = {c: 0 for c in (*causes, "other")}
    busy_ns, t = 0, lo
    for when, delta, slot in events:
        if when > t:
            span = when - t
            if open_[-1]:
                busy_ns += span
            else:
                first = next((i for i in range(len(causes)) if open_[i]), None)
                idle["other" if first is None else causes[first]] += span
            t = when
        open_[slot] += delta
    if hi > t:
        idle["other"] += hi - t
    total = hi - lo
    return {
        "step_s": total / 1e9,
        "gpu_busy_s": busy_ns / 1e9,
        "gpu_idle_s": (total - busy_ns) / 1e9,
        "idle_by_cause_s": {c: v / 1e9 for c, v in idle.items()},
        # each cause's own ranges in the step (overlaps within a cause counted once per range)
        "ranged_s": {c: v / 1e9 for c, v in ranged.items()},
    }


def gpu_intervals(trace_file: Path) -> tuple[list[tuple[int, int]], tuple[float, float] | None]:
    """The GPU's busy intervals (ns, the trace's clock) and the step mark's (start, end) in
    microseconds, from a chrome trace written by ``torch.profiler``."""
    opener = gzip.open if trace_file.suffix == ".gz" else open
    with opener(trace_file, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    busy, mark = [], None
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") in GPU_CATEGORIES:
            start = float(e["ts"]) * 1e3
            busy.append((int(start), int(start + float(e.get("dur", 0.0)) * 1e3)))
        elif e.get("name") == STEP_MARK and mark is None:
            mark = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
    return busy, mark


def _rl_run_class() -> Any:
    """The class whose ``step`` runs one RL step (where the loop keeps it)."""
    from palaestra.run.rl import RLRun

    return RLRun


def trace_step(step_index: int, out_dir: Path) -> dict[str, Any]:
    """Profile RL step ``step_index`` of the next ``train`` call in this process; returns the
    dict that `finish` fills (``trace_file``, ``attribution``) once that step has run."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from palaestra import trace_ranges
    from palaestra.engines.local.cuda_graphs import CAPTURE_LOCK

    rl_run = _rl_run_class()
    original = rl_run.step
    report: dict[str, Any] = {"step": step_index}

    async def step(self: Any, step: int) -> None:
        if step != step_index:
            await original(self, step)
            return
        cuda = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        prof = profile(activities=activities)
        # the profiler synchronizes the device as it starts and stops; an engine thread may be
        # capturing a decode graph then, which a device-wide synchronize would break
        with CAPTURE_LOCK:
            if cuda:
                torch.cuda.synchronize()
            prof.start()
        with trace_ranges.record() as ranges:
            began = time.perf_counter_ns()
            try:
                with record_function(STEP_MARK):
                    await original(self, step)
            finally:
                with CAPTURE_LOCK:
                    if cuda:
                        torch.cuda.synchronize()
                    ended = time.perf_counter_ns()
                    prof.stop()
        trace_file = out_dir / f"trace-step{step}.json.gz"
        prof.export_chrome_trace(str(trace_file))
        report.update(trace_file=str(trace_file), began_ns=began, ended_ns=ended,
                      ranges=list(ranges))

    rl_run.step = step
    report["restore"] = lambda: setattr(rl_run, "step", original)
    return report


def finish(report: dict[str, Any], step_s: float | None) -> dict[str, Any] | None:
    """The attribution of the traced step: its window is the step's measured time
    (``time/step_s``) from the step's start (the whole traced call when not given)."""
    from palaestra.trace_ranges import CAUSES

    report.pop("restore", lambda: None)()
    if "trace_file" not in report:
        return None
    busy, mark = gpu_intervals(Path(report["trace_file"]))
    began, ended = int(report["began_ns"]), int(report["ended_ns"])
    if mark is not None and busy:  # the trace's clock -> perf_counter_ns, by the step mark
        offset = int(mark[0] * 1e3) - began
        busy = [(s - offset, e - offset) for s, e in busy]
    window_end = began + int(step_s * 1e9) if step_s else ended
    result = attribute((began, min(window_end, ended)), busy, report["ranges"], CAUSES)
    result.update(step=report["step"], trace_file=report["trace_file"],
                  traced_call_s=(ended - began) / 1e9, ranges=len(report["ranges"]),
                  gpu_timeline=bool(busy))
    return result


__all__ = ["GPU_CATEGORIES", "attribute", "finish", "gpu_intervals", "trace_step", "union"]

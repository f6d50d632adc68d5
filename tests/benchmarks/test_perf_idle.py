"""The loop benchmark's ``--trace``: a step's GPU idle time (host time on CPU) by named cause.

`attribute` on hand-made timelines (every idle instant to the finest open cause, the rest to
``other``), and one real traced CPU cell of ``benchmarks/perf/loop.py``: the attribution covers
exactly the step's measured time, each cause's share comes from ranges the code recorded, and
the engine, the trainer, the env/agent and the tokenizer all show up.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from palaestra import trace_ranges
from palaestra.benchmarks.perf import idle, loop

MS = 1_000_000  # ns


def test_idle_instants_go_to_the_finest_open_cause() -> None:
    causes = ("tokenization", "env_agent", "engine_step")
    busy = [(10 * MS, 30 * MS), (25 * MS, 40 * MS), (90 * MS, 95 * MS)]  # union 10-40, 90-95
    ranges = [("env_agent", 0, 60 * MS, 1), ("tokenization", 35 * MS, 50 * MS, 1),
              ("engine_step", 55 * MS, 70 * MS, 2), ("unknown", 0, 100 * MS, 3)]
    out = idle.attribute((0, 100 * MS), busy, ranges, causes)
    assert out["step_s"] == pytest.approx(0.1)
    assert out["gpu_busy_s"] == pytest.approx(0.035)
    by = out["idle_by_cause_s"]
    # idle: 0-10 env, 40-50 tokenization (inside env), 50-55 env, 55-60 env (finer than
    # engine_step), 60-70 engine_step, 70-90 and 95-100 nothing
    assert by == pytest.approx({"tokenization": 0.010, "env_agent": 0.020,
                                "engine_step": 0.010, "other": 0.025})
    assert sum(by.values()) == pytest.approx(out["gpu_idle_s"])
    assert out["ranged_s"]["engine_step"] == pytest.approx(0.015)


def test_spans_are_free_when_off_and_recorded_on_every_thread() -> None:
    import threading

    assert trace_ranges.span("tokenization") is trace_ranges.span("optimizer")  # the no-op
    with trace_ranges.record() as ranges:
        with trace_ranges.span("optimizer"):
            pass
        worker = threading.Thread(target=lambda: trace_ranges.span("engine_step").__enter__())
        worker.start()
        worker.join()

        def closed() -> None:
            with trace_ranges.span("engine_step"):
                pass

        worker = threading.Thread(target=closed)
        worker.start()
        worker.join()
    assert [r[0] for r in ranges] == ["optimizer", "engine_step"]
    assert len({r[3] for r in ranges}) == 2 and all(r[2] >= r[1] for r in ranges)
    assert trace_ranges.span("optimizer") is trace_ranges.span("tokenization")


def test_the_profiler_starts_and_stops_only_between_graph_captures(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The profiler synchronizes the device as it starts and stops; an embedded engine capturing
    # a decode graph on its own thread then fails ("operation not permitted when stream is
    # capturing", seen on one H100). Both happen under the engine's capture lock, and the step
    # itself runs with the lock free, so the engine can still capture during it.
    import asyncio

    import torch.profiler

    from palaestra.engines.local.cuda_graphs import CAPTURE_LOCK

    seen: dict[str, bool] = {}

    class Profile:
        def __init__(self, activities: object) -> None:
            pass

        def start(self) -> None:
            seen["start"] = CAPTURE_LOCK.locked()

        def stop(self) -> None:
            seen["stop"] = CAPTURE_LOCK.locked()

        def export_chrome_trace(self, path: str) -> None:
            Path(path).write_bytes(b"")

    class Run:
        async def step(self, step: int) -> None:
            seen[f"step {step}"] = CAPTURE_LOCK.locked()

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    monkeypatch.setattr(idle, "_rl_run_class", lambda: Run)
    report = idle.trace_step(1, tmp_path)
    asyncio.run(Run().step(0))
    asyncio.run(Run().step(1))
    report.pop("restore")()
    assert seen == {"step 0": False, "start": True, "step 1": False, "stop": True}
    assert Path(report["trace_file"]).name == "trace-step1.json.gz"


@pytest.mark.slow  # one short training run in a subprocess: ~20-40 s on the 2-core machine
def test_traced_cpu_cell_attributes_the_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # configs/quickstart.toml
    out = tmp_path / "loop.json"
    rc = loop.main(["--device", "cpu", "--modes", "sync", "--trace", "--work-dir",
                    str(tmp_path / "w"), "--json", str(out)])
    assert rc == 0
    (cell,) = json.loads(out.read_text())["cells"]
    trace = cell["trace"]
    steady = cell["raw_steps"][1]
    assert trace["step"] == 1 and not trace["gpu_timeline"] and trace["gpu_busy_s"] == 0.0
    # the window is the step's measured time, and every second of it is attributed
    assert trace["step_s"] == pytest.approx(steady["time/step_s"], abs=2e-3)
    by = trace["idle_by_cause_s"]
    assert sum(by.values()) == pytest.approx(trace["step_s"], rel=1e-6)
    assert trace["traced_call_s"] >= trace["step_s"]
    for cause in ("engine_step", "train_compute", "optimizer", "trainer_data", "env_agent",
                  "tokenization", "admission_stop", "weight_sync"):
        assert trace["ranged_s"][cause] > 0, cause
        assert 0 <= by[cause] <= trace["ranged_s"][cause] + 1e-9, cause
    # on CPU the model computes on the host: the engine's and trainer's compute lead
    assert by["engine_step"] + by["train_compute"] > 0.3 * trace["step_s"]
    assert Path(trace["trace_file"]).stat().st_size > 0
    assert "GPU idle seconds of the traced step by cause" in capsys.readouterr().out

"""The branching benchmark in its small setting: it runs, and branching generates fewer tokens
and runs fewer sandbox cells than independent episodes for the same leaves (counts, not times)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.slow
def test_branching_benchmark_quick(tmp_path: Path) -> None:
    from palaestra.benchmarks.perf.branching import main

    out = tmp_path / "branching.json"
    assert main(["--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {r["setting"] for r in rows} == {"calculator", "echo-local", "python-session",
                                            "python-50ms"}
    assert all(r["leaves"] > 0 and r["failed"] == 0 for r in rows)
    ratios = result["ratios"]
    for setting, r in ratios.items():
        assert r["generated_token_ratio"] > 1.2, (setting, r)
        assert r["request_ratio"] > 1.2, (setting, r)
    assert ratios["echo-local"]["prefill_token_ratio"] > 1.0
    assert ratios["python-session"]["sandbox_run_ratio"] == pytest.approx(32 / 22)

"""`benchmarks/perf/loop.py` on CPU: the real ``palaestra train`` loop, one subprocess per cell.

The small CPU version of the GPU matrix (tiny quickstart model, 4 prompts x 2, 16 new tokens,
2 RL steps, sync and async): every cell must finish, and the per-step breakdown, tokens/s and
the async-vs-sync verdict must come out of the run's own metrics.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from palaestra.benchmarks.perf import loop


@pytest.mark.slow  # two short training runs in subprocesses: 25-70 s on the 2-core machine
def test_cpu_matrix_runs_the_training_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # configs/quickstart.toml
    out = tmp_path / "loop.json"
    rc = loop.main(["--device", "cpu", "--work-dir", str(tmp_path / "w"), "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    cells = {c["mode"]: c for c in result["cells"]}
    assert set(cells) == {"sync", "async"}
    for mode, cell in cells.items():
        assert cell["returncode"] == 0 and cell["backend"] == "torch"
        assert len(cell["raw_steps"]) == 2 and cell["steady_steps"] == 1
        assert ["--rollout.mode", mode] == cell["overrides"][
            cell["overrides"].index("--rollout.mode"):][:2]
        assert cell["tokens"] > 0 and cell["tokens_per_s"] > 0
        assert cell["step_s"] >= cell["train_s"] > 0
        assert cell["step_s"] == pytest.approx(
            cell["rollout_s"] + cell["train_s"] + cell["weight_sync_s"], rel=1e-6)
        assert cell["params"] > 0 and 0 < cell["mfu"] < 1
        assert not (tmp_path / "w" / cell["name"] / "run").exists()  # checkpoints removed
    assert len(result["verdicts"]) == 1 and "async" in result["verdicts"][0]
    printed = capsys.readouterr().out
    assert "| tiny | 0.49M | torch | sync | default |" in printed  # the parameters shown
    assert os.environ["OMP_NUM_THREADS"] == "1"


def test_summary_means_the_steady_steps() -> None:
    steps = [{"time/step_s": 10.0, "time/rollout_s": 8.0, "time/train_s": 2.0,
              "time/weight_sync_s": 0.0, "train/num_tokens": 100.0},
             {"time/step_s": 2.0, "time/rollout_s": 1.0, "time/train_s": 1.0,
              "time/weight_sync_s": 0.0, "train/num_tokens": 1000.0, "idle_gpu_s": 0.5},
             {"time/step_s": 4.0, "time/rollout_s": 3.0, "time/train_s": 1.0,
              "time/weight_sync_s": 0.0, "train/num_tokens": 1000.0, "idle_gpu_s": 1.5}]
    s = loop.summarize({"steps": steps, "params": 1e9}, skip=1, nominal=2e9)
    assert s["steady_steps"] == 2 and s["step_s"] == 3.0 and s["idle_gpu_s"] == 1.0
    assert s["tokens_per_s"] == pytest.approx(1000 / 3)
    assert s["mfu"] == pytest.approx(12 * 1e9 * 1000 / (3.0 * 989e12))
    assert s["mfu_nominal"] == pytest.approx(2 * s["mfu"])

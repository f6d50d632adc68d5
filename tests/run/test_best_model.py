"""``[benchmark_eval] keep_best``: the policy at its best validation score so far, kept whole
through a failed export and across a resume, and wired into a real training run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from palaestra.config import load_config, validate
from palaestra.errors import ConfigError
from palaestra.run.best_model import BestModel
from palaestra.run.config import TrainConfig
from palaestra.run.evaluation import EvalConfig

METRIC = "eval/multihop_validation/pass@1"


def _export_step(step: int):
    def export(directory: Path) -> None:
        directory.mkdir(parents=True)
        (directory / f"weights-of-step-{step}").write_text("")
    return export


def _weights(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "best-model").iterdir() if p.name.startswith("weights"))


def test_the_best_score_so_far_is_kept_ties_and_missing_scores_are_not(tmp_path):
    best = BestModel(METRIC, tmp_path)
    assert best.metrics() == {}
    chosen = [best.consider(step, {METRIC: value} if value is not None else {}, _export_step(step))
              for step, value in [(5, 0.1), (10, 0.3), (15, 0.3), (20, None), (25, 0.2)]]
    assert chosen == [True, True, False, False, False]
    assert _weights(tmp_path) == ["weights-of-step-10"]  # step 5's files are gone
    assert json.loads((tmp_path / "best-model" / "selected.json").read_text()) == \
        {"metric": METRIC, "step": 10, "value": 0.3}
    assert best.metrics() == {"best/step": 10.0, "best/value": 0.3}
    assert not best.consider(30, {METRIC: float("nan")}, _export_step(30))


def test_a_resumed_run_selects_as_the_uninterrupted_one(tmp_path):
    BestModel(METRIC, tmp_path).consider(10, {METRIC: 0.3}, _export_step(10))
    resumed = BestModel(METRIC, tmp_path)
    assert (resumed.step, resumed.value) == (10, 0.3)
    assert not resumed.consider(15, {METRIC: 0.25}, _export_step(15))
    # another metric starts over
    assert BestModel("eval/other/pass@1", tmp_path).step is None


def test_an_export_that_fails_leaves_the_earlier_best_whole(tmp_path):
    best = BestModel(METRIC, tmp_path)
    best.consider(5, {METRIC: 0.1}, _export_step(5))

    def dies_half_way(directory: Path) -> None:
        directory.mkdir(parents=True)
        (directory / "weights-of-step-10").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        best.consider(10, {METRIC: 0.3}, dies_half_way)
    assert _weights(tmp_path) == ["weights-of-step-5"]
    assert (BestModel(METRIC, tmp_path).step, best.step) == (5, 5)


def test_keep_best_must_name_a_metric_of_the_evaluations():
    with pytest.raises(ConfigError, match="eval/<benchmark>/<metric>"):
        validate(EvalConfig, {"benchmarks": ["calculator"], "interval": 5,
                              "keep_best": "eval/gsm8k/pass@1"})
    with pytest.raises(ConfigError, match="set interval"):
        validate(EvalConfig, {"benchmarks": ["calculator"], "keep_best": "eval/calculator/pass@1"})
    ok = validate(EvalConfig, {"benchmarks": ["calculator"], "interval": 5,
                               "keep_best": "eval/calculator/pass@1"})
    assert ok.keep_best == "eval/calculator/pass@1"


def test_a_training_run_exports_its_best_evaluated_policy(tmp_path):
    from palaestra.run.train import train
    from palaestra.tiny_model import build_model

    model = build_model(tmp_path / "model", "micro")
    config = tmp_path / "run.toml"
    config.write_text(f'''
out = "{tmp_path / "run"}"
seed = 0
[model]
path = "{model}"
[env]
id = "palaestra/Calculator-v0"
[agent]
max_context = 1024
[rollout]
batch_size = 2
group_size = 2
max_new_tokens = 8
cluster = "local"
num_workers = 1
[engine]
device = "cpu"
[trainer]
steps = 2
[trainer.torch]
device = "cpu"
pack_sequences = false
[eval]
num_tasks = 0
[benchmark_eval]
benchmarks = ["calculator"]
interval = 1
limit = 2
max_new_tokens = 8
keep_best = "eval/calculator/pass@1"
[logging]
progress = false
tensorboard = false
''')
    train(load_config(TrainConfig, config, []))
    run = tmp_path / "run"
    rl = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
          if json.loads(line).get("phase") == "rl"]
    scores = [r["eval/calculator/pass@1"] for r in rl]
    assert len(scores) == 2
    # the first evaluation is the best so far; the second is kept only if strictly better
    expected = 2 if scores[1] > scores[0] else 1
    selected = json.loads((run / "best-model" / "selected.json").read_text())
    assert selected == {"metric": "eval/calculator/pass@1", "step": expected,
                        "value": max(scores)}
    assert rl[-1]["best/step"] == expected
    # a Hugging Face folder with the settings it was trained under, as final-model is
    assert (run / "best-model" / "config.json").is_file()
    assert (run / "best-model" / "trained_with.json").is_file()
    assert not (run / "best-model.partial").exists()

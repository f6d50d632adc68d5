"""Evaluation during training: the schedule, the flat metrics, the saved samples per step."""

from __future__ import annotations

import json

import pytest

from palaestra.benchmarks.training import EvalConfig, TrainingEvaluator, flatten
from palaestra.config import validate
from palaestra.errors import ConfigError


def test_config_validation_lists_problems():
    with pytest.raises(ConfigError, match="benchmarks is empty"):
        validate(EvalConfig, {"interval": 10})
    config = validate(EvalConfig, {"benchmarks": ["gsm8k"], "interval": 10, "limit": 5})
    assert config.n == 1 and config.temperature == 0.0


def test_schedule(tokenizer):
    config = EvalConfig(benchmarks=["gsm8k"], interval=5, at_start=True)
    evaluator = TrainingEvaluator(config, tokenizer=tokenizer)
    assert [s for s in range(12) if evaluator.due(s)] == [0, 5, 10]
    off = TrainingEvaluator(EvalConfig(benchmarks=["gsm8k"]), tokenizer=tokenizer)
    assert not any(off.due(s) for s in range(12))
    with pytest.raises(ConfigError, match="gsm8k"):
        TrainingEvaluator(EvalConfig(benchmarks=["gsm9k"], interval=1), tokenizer=tokenizer)


async def test_evaluate_returns_training_metrics_and_saves_samples(tmp_path, tokenizer, gold_engine, gsm8k_rows):
    questions = sorted(row["question"].strip() for row in gsm8k_rows)[:4]
    right = set(questions[:1])
    engine = gold_engine(lambda q, seed, count: q in right)
    config = EvalConfig(benchmarks=["gsm8k"], interval=2, limit=4, n=2, temperature=0.6)
    evaluator = TrainingEvaluator(config, tokenizer=tokenizer, max_context=2048, run_dir=tmp_path)
    metrics = await evaluator.evaluate(engine, step=2)
    # the first 4 gsm8k tasks are the ones evaluated; one of them is answered right
    first_four = {r["question"].strip() for r in gsm8k_rows[:4]}
    expected = len(right & first_four) / 4
    assert metrics["eval/gsm8k/pass@1"] == pytest.approx(expected)
    assert metrics["eval/gsm8k/pass@2"] == pytest.approx(expected)
    assert metrics["eval/gsm8k/mean_reward"] == pytest.approx(expected)
    assert metrics["eval/gsm8k/error_rate"] == 0.0
    assert evaluator.history == [(2, metrics)]
    saved = tmp_path / "eval" / "step_000002"
    assert len((saved / "samples.jsonl").read_text().splitlines()) == 8
    assert json.loads((saved / "summary.json").read_text())["gsm8k"]["model"] == "step-2"


def test_flatten_skips_missing_values():
    flat = flatten({"b": {"n": 2, "pass@1": 0.5, "pass@2": 0.75, "mean": 0.5, "samples": 4, "errors": 1}})
    assert flat == {
        "eval/b/pass@1": 0.5,
        "eval/b/pass@2": 0.75,
        "eval/b/mean_reward": 0.5,
        "eval/b/error_rate": 0.25,
    }

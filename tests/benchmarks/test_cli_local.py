"""The real CLI on a real model: ``palaestra eval --engine local`` with a micro checkpoint."""

from __future__ import annotations

import json


def test_eval_local_engine_end_to_end(model_dir, tmp_path, capsys):
    from palaestra.cli import main

    out = tmp_path / "run"
    argv = ["eval", "--benchmark", "calculator,gsm8k", "--engine", "local", "--model", model_dir,
            "--n", "2", "--limit", "3", "--max-new-tokens", "12", "--temperature", "1.0",
            "--concurrency", "4", "--out", str(out), "--no-progress", "--no-report"]
    assert main(argv) == 0
    assert "calculator: pass@1" in capsys.readouterr().out
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 12
    for r in records:
        sample = r["trajectory"]["samples"][0]
        assert sum(sample["loss_mask"]) == r["completion_tokens"] > 0
        assert all(lp <= 0 for lp, m in zip(sample["logprobs"], sample["loss_mask"]) if m)
        assert r["stop_reason"] in ("max_tokens", "terminated", "truncated", "parse_error")
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"calculator", "gsm8k"}
    assert summary["gsm8k"]["tasks"] == 3 and summary["gsm8k"]["n"] == 2
    # a rerun of the same command resumes and has nothing left to draw
    assert main(argv) == 0
    assert len((out / "samples.jsonl").read_text().splitlines()) == 12


def test_a_model_plays_as_trained_but_is_scored_by_the_benchmark():
    """`palaestra eval` plays a trained model with its run's env kwargs (prompt, budgets), but
    the kwargs that define the score stay the benchmark's: a run trained on the Search-R1 env's
    token-F1 reward is still scored by exact match."""
    from palaestra.benchmarks.builtin import SEARCH_R1_SMOLLM2_ENV_KWARGS
    from palaestra.benchmarks.cli import played_as_trained

    trained = {**SEARCH_R1_SMOLLM2_ENV_KWARGS, "passage_words": 30, "reward": "f1",
               "format_reward": 0.1}
    played = played_as_trained({**SEARCH_R1_SMOLLM2_ENV_KWARGS, "format_reward": 0.0}, trained)
    assert played["passage_words"] == 30  # how the episode plays: the run's
    assert "reward" not in played and played["format_reward"] == 0.0  # the score: the benchmark's

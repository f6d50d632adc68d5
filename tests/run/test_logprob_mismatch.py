"""``rollout/logprob_{max,mean}_abs_diff`` on every RL step of a short real run (CPU)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from palaestra.config import load_config
from palaestra.run.config import TrainConfig
from tests.run.test_loop import _grpo_on_long_env, _read, _write_config, micro_model, yes_env

pytestmark = pytest.mark.numerics  # engine vs trainer logprob mismatch metrics

__all__ = ["micro_model", "yes_env"]  # the fixtures, imported for pytest


def _run(tmp_path: Path, model: Path, extra: list[str]) -> list[dict]:
    from palaestra.run.train import train

    body = _grpo_on_long_env(tmp_path, model, steps=2)
    overrides = ["--rollout.batch_size", "4", "--rollout.group_size", "4", "--eval.num_tasks",
                 "0", "--trainer.torch.lr", "0.05", *extra]
    train(load_config(TrainConfig, _write_config(tmp_path, body), overrides))
    return [r for r in _read(tmp_path / "run" / "metrics.jsonl") if r["phase"] == "rl"]


def _check(rows: list[dict]) -> None:
    assert len(rows) == 2
    for r in rows:
        top, mean = r["rollout/logprob_max_abs_diff"], r["rollout/logprob_mean_abs_diff"]
        assert math.isfinite(top) and math.isfinite(mean)
        assert 0.0 <= mean <= top
        # fp32 engine vs fp32 trainer, same weights: kernel-order noise only (measured ~1e-6)
        assert top < 1e-3, f"engine and trainer disagree: max |diff| {top}"
        assert not any(k.startswith(("first_update/", "train/rollout/")) for k in r)
    print("logprob |diff| max/mean per step:",
          [(r["rollout/logprob_max_abs_diff"], r["rollout/logprob_mean_abs_diff"]) for r in rows])


def test_mismatch_logged_every_step(tmp_path, micro_model, yes_env):
    _check(_run(tmp_path, micro_model, ["--trainer.torch.dtype", "float32"]))


def test_mismatch_taken_before_the_update(tmp_path, micro_model, yes_env):
    """Two updates per batch: the metric is the first update's (the sampling weights), so it
    stays as small as with one; the second update's forward would see moved weights."""
    _check(_run(tmp_path, micro_model, ["--trainer.torch.dtype", "float32",
                                        "--trainer.updates_per_batch", "2"]))


def test_mismatch_logged_in_async_mode(tmp_path, micro_model, yes_env):
    """Async mode: logged on every step as well; the trainer may be a version ahead of the
    batch's sampler (max_staleness 1), so only its sanity is asserted."""
    rows = _run(tmp_path, micro_model, ["--trainer.torch.dtype", "float32", "--rollout.mode",
                                        "async", "--rollout.max_staleness", "1"])
    assert len(rows) == 2
    for r in rows:
        top, mean = r["rollout/logprob_max_abs_diff"], r["rollout/logprob_mean_abs_diff"]
        assert math.isfinite(top) and 0.0 <= mean <= top
    print("async logprob |diff| max/mean per step:",
          [(r["rollout/logprob_max_abs_diff"], r["rollout/logprob_mean_abs_diff"]) for r in rows])

"""`scripts/calculator_value_bound.py`: the explained-variance ceiling of an oracle critic."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts/calculator_value_bound.py"


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("calculator_value_bound", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_digit_error_no_critic_can_foresee_caps_the_explained_variance() -> None:
    bound = _script().oracle_explained_variance
    # one structural token, then one digit sampled right half the time: before either token the
    # outcome is a coin flip (variance 0.25) for the episode that succeeds; the lost one counts
    # as known throughout. Mean variance left 0.125 of 0.25: a ceiling of 0.5.
    out = bound([([False, True], 1.0), ([False, True], 0.0)])
    assert out["error_per_digit"] == pytest.approx(0.5)
    assert out["explained_variance_ceiling"] == pytest.approx(0.5)
    # more structural tokens before the digit change nothing; the same odds spread over four
    # digits reveal the outcome digit by digit, so later tokens are better known
    late = bound([([False] * 5 + [True], 1.0), ([False] * 5 + [True], 0.0)])
    assert late["explained_variance_ceiling"] == pytest.approx(0.5)
    many = bound([([True] * 4, 1.0), ([True] * 4, 0.0)])
    assert 0.5 < many["explained_variance_ceiling"] < 0.6  # 1 - 0.104 / 0.25
    # a failure decided by the first sampled token is known from the second token on: only the
    # first of the successful episode's two tokens is uncertain, 0.0625 of 0.25 left
    early = bound([([False, True], 1.0), ([False, True], 0.0)], early_failures=1)
    assert early["error_per_digit"] == pytest.approx(0.0)
    assert early["explained_variance_ceiling"] == pytest.approx(0.75)

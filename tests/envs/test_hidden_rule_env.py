"""``palaestra/HiddenRule-v0``: the hidden rule decides the reward, the example's preference
pairs follow it (chosen answers score 1 in the env, rejected 0), the demonstrations do not know
it, and bad settings are refused."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from palaestra.envs.hidden_rule import HiddenRuleEnv, demonstrations
from palaestra.envs.registry import make
from palaestra.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def _reward(env: HiddenRuleEnv, task: dict, text: str) -> float:
    env.reset(options={"task": task})
    return env.step(text)[1]


def test_reward_needs_the_range_and_the_rule():
    env = make("palaestra/HiddenRule-v0")
    obs, _ = env.reset(seed=3)
    low = env.task["low"]
    assert obs[1].content == f"Give a number from {low} to {low + 9}."
    task = dict(env.task)
    assert _reward(env, task, f"<answer>{low + 4}</answer>") == 1.0
    assert _reward(env, task, f"<answer>{low + 5}</answer>") == 0.0      # breaks the rule
    assert _reward(env, task, f"<answer>{low + 10}</answer>") == 0.0     # out of range
    assert _reward(env, task, f"{low + 4}") == 0.0                       # no answer tag
    odd = HiddenRuleEnv(rule="odd")
    assert _reward(odd, task, f"<answer>{low + 5}</answer>") == 1.0


def test_example_pairs_follow_the_rule_and_demonstrations_do_not():
    spec = importlib.util.spec_from_file_location(
        "make_rm_example_data", REPO / "scripts" / "make_rm_example_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    rows = module.make_pairs(300, seed=5)
    assert rows == module.make_pairs(300, seed=5)
    env = HiddenRuleEnv()
    kinds = set()
    for row in rows:
        task = {"question": row["prompt"][1]["content"]}
        task["low"] = int(task["question"].split()[4])
        task["high"] = task["low"] + 9
        assert _reward(env, task, row["chosen"][0]["content"]) == 1.0
        assert _reward(env, task, row["rejected"][0]["content"]) == 0.0
        kinds.add(row["kind"])
    assert kinds == {"breaks_rule", "out_of_range"}
    demos = demonstrations(400, seed=0)
    right = sum(_reward(env, {"question": d[1]["content"],
                              "low": int(d[1]["content"].split()[4]),
                              "high": int(d[1]["content"].split()[4]) + 9},
                        d[2]["content"]) for d in demos)
    assert 0.4 < right / len(demos) < 0.6  # in range always, the rule by chance


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="rule must be one of"):
        HiddenRuleEnv(rule="prime")
    with pytest.raises(ConfigError, match="min_decade"):
        HiddenRuleEnv(min_decade=50, max_decade=20)

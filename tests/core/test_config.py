"""Config machinery: TOML + dotted overrides, all problems in one error, help from docstrings."""

import json

import pytest

from palaestra.config import Section, describe_fields, load_config, parse_overrides, save_resolved
from palaestra.errors import ConfigError


class Rollout(Section):
    group_size: int = 4
    """Samples per prompt."""
    temperature: float = 1.0
    """Sampling temperature."""


class Run(Section):
    name: str = "run"
    """Name of the run."""
    rollout: Rollout = Rollout()


def test_overrides_parse_types_and_nesting():
    assert parse_overrides(["--rollout.group_size", "8", "--name=x", "--flag"]) == {
        "rollout": {"group_size": 8},
        "name": "x",
        "flag": True,
    }


def test_load_merges_file_and_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('name = "file"\n[rollout]\ngroup_size = 2\ntemperature = 0.5\n')
    cfg = load_config(Run, path, ["--rollout.group_size", "16"])
    assert cfg.name == "file" and cfg.rollout.group_size == 16 and cfg.rollout.temperature == 0.5
    saved = save_resolved(cfg, tmp_path / "run")
    assert json.loads(saved.read_text())["rollout"]["group_size"] == 16


def test_one_error_lists_every_problem(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[rollout]\ngroup_size = "many"\ntemprature = 0.5\n')
    with pytest.raises(ConfigError) as info:
        load_config(Run, path, ["--nmae", "x"])
    text = str(info.value)
    assert "3 problem(s)" in text
    assert "rollout.group_size" in text and "rollout.temprature" in text and "nmae" in text


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Run, tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("= 3")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(Run, bad)


def test_help_comes_from_docstrings():
    lines = list(describe_fields(Run))
    assert any(line.startswith("--rollout.group_size (int = 4): Samples per prompt.") for line in lines)

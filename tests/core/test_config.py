"""Config machinery: TOML + dotted overrides, all problems in one error, help from docstrings."""

import json
from typing import Annotated, Literal

import pydantic
import pytest
from pydantic import Field

from palaestra.config import (
    ConfigProblems,
    Problem,
    Section,
    describe_fields,
    load_config,
    parse_overrides,
    save_resolved,
    validate,
)
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


class Checked(Section):
    """A section whose validator checks across fields (as TrainConfig's does)."""

    size: int = pydantic.Field(4, ge=1)
    """Items per batch."""
    group: int = 2
    """Items per group."""
    name: str = "x"
    """A name."""

    @pydantic.model_validator(mode="after")
    def _across(self) -> "Checked":
        problems = []
        if self.size % self.group:
            problems.append(Problem(("size", "group"), f"size {self.size} % group {self.group}"))
        if self.name == "bad":
            problems.append(Problem(("name",), "name must not be 'bad'; rename it"))
        if problems:
            raise ConfigProblems(problems)
        return self


def test_checks_across_fields_are_reported_beside_field_errors():
    with pytest.raises(ConfigError) as info:
        validate(Checked, {"size": 0, "group": 3, "name": "bad"})
    text = str(info.value)
    # size is invalid, so the problem involving it is left out; the name's is reported with it
    assert "2 problem(s)" in text
    assert "size = 0: must be >= 1 (Items per batch)" in text
    assert "name must not be 'bad'; rename it" in text and "% group" not in text
    with pytest.raises(ConfigError, match="size 5 % group 2"):
        validate(Checked, {"size": 5})
    assert validate(Checked, {"size": 6, "group": 3}).size == 6


def test_unknown_keys_name_their_close_match():
    with pytest.raises(ConfigError, match=r"rollout\.group_sise: unknown field; did you mean "
                                          r"rollout\.group_size\?"):
        validate(Run, {"rollout": {"group_sise": 3}})


def test_config_problems_survive_pickling():
    import pickle

    err = pickle.loads(pickle.dumps(ConfigProblems([Problem(("a",), "fix a")])))
    assert err.problems == (Problem(("a",), "fix a"),) and str(err) == "fix a"


# ---------------------------------------------------------------------- tagged unions

class Gloo(Section):
    kind: Literal["gloo"] = "gloo"
    timeout_s: float = Field(10.0, gt=0)
    """Seconds a broadcast may take."""


class Files(Section):
    kind: Literal["files"] = "files"
    folder: str = "/tmp/w"
    """Where the weights are written."""
    bucket_mb: int = Field(64, ge=1)
    """Bucket size."""


class Trainer(Section):
    sync: Annotated[Gloo | Files, Field(discriminator="kind")] = Field(default_factory=Gloo)
    """How weights move."""
    lr: float = Field(1e-3, gt=0)
    """Learning rate."""


def test_a_union_variant_is_chosen_by_kind_and_keeps_its_own_settings(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[sync]\nkind = "files"\nfolder = "/data"\n')
    cfg = load_config(Trainer, path, ["--sync.bucket_mb", "8"])
    assert cfg.sync == Files(folder="/data", bucket_mb=8)
    assert load_config(Trainer).sync == Gloo()


def test_union_errors_name_fields_without_the_tag_and_say_which_kind_has_a_field():
    with pytest.raises(ConfigError) as err:
        validate(Trainer, {"sync": {"kind": "files", "timeout_s": 3, "bucket_mb": 0,
                                    "foldr": "x"}, "lr": -1})
    text = str(err.value)
    assert "4 problem(s)" in text  # every problem at once, inside and beside the union
    assert ("sync.timeout_s: unknown field; it is a setting of sync.kind = 'gloo', the 'files' "
            "kind never reads it") in text
    assert "sync.bucket_mb = 0: must be >= 1 (Bucket size)" in text
    assert "sync.foldr: unknown field; did you mean sync.folder?" in text
    assert "lr = -1: must be > 0.0 (Learning rate)" in text
    with pytest.raises(ConfigError, match=r"sync.kind = 'disk': must be one of 'gloo', 'files'"):
        validate(Trainer, {"sync": {"kind": "disk"}})


def test_help_lists_the_kinds_and_every_variants_fields_with_the_kinds_that_read_them():
    lines = list(describe_fields(Trainer))
    assert lines[0] == "--sync.kind (one of 'gloo', 'files' = 'gloo'): How weights move."
    assert "--sync.timeout_s (float = 10.0) [kind gloo]: Seconds a broadcast may take." in lines
    assert "--sync.folder (str = '/tmp/w') [kind files]: Where the weights are written." in lines
    assert lines[-1] == "--lr (float = 0.001): Learning rate."

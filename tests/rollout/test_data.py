"""The data source: file formats, env ids, seeded epochs and a resumable position."""

from __future__ import annotations

import gzip
import json

import pytest

from palaestra.errors import CheckpointError, ConfigError
from palaestra.rollout.data import DataSource, load_rows

ROWS = [{"env_id": "palaestra/Calculator-v0", "id": f"r{i}", "question": f"q{i}", "answer": str(i)}
        for i in range(10)]


def test_json_formats_give_the_same_rows(tmp_path):
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in ROWS) + "\n")
    for path in ("d.jsonl", "d.json", "d.jsonl.gz"):
        assert load_rows(tmp_path / path) == ROWS, path


def test_parquet_and_hf_folders_give_the_same_rows(tmp_path):
    datasets = pytest.importorskip("datasets")  # also brings pyarrow
    ds = datasets.Dataset.from_list(ROWS)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "hf"))
    for path in ("d.parquet", "hf"):
        assert load_rows(tmp_path / path) == ROWS, path


def test_rows_name_env_and_task():
    nested = [{"env": "palaestra/Calculator-v0", "task": {"id": "n1", "question": "q"}}]
    item = DataSource(nested).next()
    assert item.env_id == "palaestra/Calculator-v0" and item.task == {"id": "n1", "question": "q"}
    assert item.task_id == "n1"
    flat = DataSource([{"question": "q", "answer": "1"}], env_id="palaestra/Calculator-v0").next()
    assert flat.task == {"question": "q", "answer": "1"} and len(flat.task_id) == 16
    with pytest.raises(ConfigError, match="names no env"):
        DataSource([{"question": "q"}])


def test_epochs_are_seeded_permutations():
    src = DataSource(ROWS, seed=3, epochs=2)
    drawn = [(it.epoch, it.index) for it in src]
    assert len(drawn) == 20 and src.next() is None and src.exhausted
    for epoch in (0, 1):
        assert sorted(i for e, i in drawn if e == epoch) == list(range(10))
    assert [i for e, i in drawn if e == 0] != [i for e, i in drawn if e == 1]
    again = [(it.epoch, it.index, it.seed) for it in DataSource(ROWS, seed=3, epochs=2)]
    assert [(e, i) for e, i, _ in again] == drawn
    other = [it.index for it in DataSource(ROWS, seed=4, epochs=1)]
    assert other != [i for e, i in drawn if e == 0]
    assert [it.index for it in DataSource(ROWS, shuffle=False)] == list(range(10))
    assert len({s for _, _, s in again}) == 20  # every draw has its own seed


def test_position_resumes_exactly():
    full = [(it.epoch, it.index, it.seed) for it in DataSource(ROWS, seed=1, epochs=3)]
    src = DataSource(ROWS, seed=1, epochs=3)
    head = [src.next() for _ in range(13)]
    state = json.loads(json.dumps(src.state_dict()))  # survives a JSON checkpoint
    resumed = DataSource(ROWS, seed=1, epochs=3)
    resumed.load_state_dict(state)
    tail = [(it.epoch, it.index, it.seed) for it in resumed]
    assert [(it.epoch, it.index, it.seed) for it in head] + tail == full
    with pytest.raises(CheckpointError, match="same data files"):
        DataSource(ROWS[:5]).load_state_dict(state)


def test_bad_input_is_explained(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"env_id": "x"}\n{not json}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2"):
        load_rows(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_rows(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match="unsupported"):
        (tmp_path / "x.csv").write_text("a")
        load_rows(tmp_path / "x.csv")
    with pytest.raises(ConfigError, match="epochs"):
        DataSource(ROWS, epochs=0)

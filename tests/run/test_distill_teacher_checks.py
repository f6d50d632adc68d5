"""`run.distill.check_teacher`: the teacher must be a model folder whose token ids mean what the
student's do (vocabulary size, then the tokenizer.json vocabulary, BPE or unigram)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from palaestra.errors import ConfigError
from palaestra.run.phases.distill import check_teacher


def _model(path: Path, vocab: object, vocab_size: int = 3) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"vocab_size": vocab_size}))
    (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab},
                                                     "added_tokens": []}))
    return path


def test_a_missing_teacher_folder_says_what_to_point_at(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no config.json"):
        check_teacher(tmp_path / "nowhere", None)


def test_vocab_size_and_bpe_vocabularies_are_compared(tmp_path: Path) -> None:
    student = _model(tmp_path / "s", {"a": 0, "b": 1, "c": 2})
    check_teacher(_model(tmp_path / "same", {"a": 0, "b": 1, "c": 2}), student)
    with pytest.raises(ConfigError, match="vocab_size 4"):
        check_teacher(_model(tmp_path / "big", {"a": 0}, vocab_size=4), student)
    with pytest.raises(ConfigError, match="different tokenizers"):
        check_teacher(_model(tmp_path / "swapped", {"a": 1, "b": 0, "c": 2}), student)


def test_unigram_vocabularies_compare_ids_not_scores(tmp_path: Path) -> None:
    # the same pieces and scores in another order: other ids for the same pieces
    student = _model(tmp_path / "s", [["a", -1.0], ["b", -1.0], ["c", -2.0]])
    check_teacher(_model(tmp_path / "same", [["a", -1.0], ["b", -1.0], ["c", -2.0]]), student)
    with pytest.raises(ConfigError, match="different tokenizers"):
        check_teacher(_model(tmp_path / "reordered", [["b", -1.0], ["a", -1.0], ["c", -2.0]]),
                      student)

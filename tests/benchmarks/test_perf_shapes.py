"""The benchmarks' model shapes: real model cards, the quickstart tokenizer padded to them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from palaestra.agents.codec import TokenCodec
from palaestra.benchmarks.perf import shapes


def test_padded_tokenizer_decodes_every_id_and_encodes_as_before() -> None:
    from palaestra.tiny_model import build_tokenizer

    base = build_tokenizer()
    padded = shapes.padded_tokenizer(2048)
    assert len(padded) == 2048 and len(base) < 2048
    text = padded.apply_chat_template([{"role": "user", "content": "What is 12 * 7?"}],
                                      tokenize=False, add_generation_prompt=True)
    assert padded.encode(text) == base.encode(text)  # no merge reaches a reserved entry
    assert padded.decode([2047, len(base)]) == f"[reserved_2047][reserved_{len(base)}]"
    assert padded.all_special_ids == base.all_special_ids
    assert TokenCodec(padded).piecewise  # the added tokens stay the template's own
    with pytest.raises(Exception, match="below"):
        shapes.padded_tokenizer(16)


def test_named_shapes_are_the_model_cards(tmp_path: Path) -> None:
    cards = shapes.model_cards()
    card = cards["qwen3-0.6b"]
    assert (card["head_dim"], card["vocab_size"], card["hidden_size"]) == (128, 151936, 1024)
    (tmp_path / "config.json").write_text(json.dumps(dict(card)))
    assert shapes.parameter_count(tmp_path) == 596_049_920  # Qwen3-0.6B's 596M
    legacy = {"model_type": "qwen3", "vocab_size": 768, "hidden_size": 1024,
              "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    assert round(shapes.parameter_count(tmp_path) / 1e6) == 353  # the figures before 12-04
    assert {"qwen3-0.6b", "qwen3-0.6b-legacy", "tiny"} <= set(shapes.shape_names())
    with pytest.raises(Exception, match="unknown shape"):
        shapes.build_shape_model("qwen9-1t", tmp_path / "nope")

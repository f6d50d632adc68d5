"""The benchmarks' random-init models: real model cards, the quickstart tokenizer padded to them.

A named shape (``qwen3-0.6b``, ``qwen3-1.7b``, any key of `model_cards`) is built from its public
model card: every config.json field of the card (Qwen3: head_dim 128, a vocabulary of 151,936,
rope theta 1e6, tied embeddings), so the benchmark pays for the real LM head, the real attention
width and the real parameter count (596M for Qwen3-0.6B). The tokenizer is the quickstart's
byte-level BPE (`palaestra.tiny_model.build_tokenizer`), its vocabulary padded with reserved
entries ``[reserved_<id>]`` up to the card's size, so that any id a random-init model samples
decodes to text. The padding is made of plain vocabulary entries, as the real Qwen3 vocabulary is
(151,643 BPE entries and a few added special tokens), not of ~150,000 added tokens: no merge
produces them, so encoding never emits one, and the added tokens stay the template's nine
(`tokenizer_costs` measures what the padding costs: load and decode times).

The old shapes stay as ``<name>-legacy`` (``qwen3-0.6b-legacy``: the layer shapes with head_dim =
hidden / heads = 64 and the unpadded ~760-token vocabulary, 353M parameters), for continuity with
the figures recorded before 2026-12-04. `palaestra.tiny_model.SIZES` names (``tiny``, ``10m``...)
build as they always did.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: the layer shapes (hidden, intermediate, layers, heads, kv heads) of the figures before
#: 2026-12-04: head_dim = hidden / heads, the quickstart tokenizer's vocabulary
LEGACY_SHAPES = {
    "qwen3-0.6b-legacy": (1024, 3072, 28, 16, 8),
    "qwen3-1.7b-legacy": (2048, 6144, 28, 16, 8),
}
RESERVED = "[reserved_{}]"


def model_cards() -> Mapping[str, Mapping[str, Any]]:
    """The public model cards (Hugging Face config.json fields) by lower-case name."""
    from palaestra.model_shapes import NAMED_SHAPES

    return NAMED_SHAPES


def shape_names() -> list[str]:
    from palaestra.tiny_model import SIZES

    return sorted({*model_cards(), *LEGACY_SHAPES, *SIZES})


def padded_tokenizer(vocab_size: int) -> Any:
    """The quickstart tokenizer with reserved vocabulary entries up to ``vocab_size`` ids."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from palaestra.tiny_model import build_tokenizer

    base = build_tokenizer()
    n = len(base)
    if vocab_size < n:
        from palaestra.errors import ConfigError

        raise ConfigError(f"vocab_size {vocab_size} is below the tokenizer's {n} tokens")
    spec = json.loads(base.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    if sorted(vocab.values()) != list(range(n)):
        raise AssertionError("the quickstart vocabulary is not contiguous")
    vocab.update({RESERVED.format(i): i for i in range(n, vocab_size)})
    spec["model"]["ignore_merges"] = False  # whole-word lookups would reach the reserved entries
    raw = Tokenizer.from_str(json.dumps(spec))
    eos, pad = base.eos_token, base.pad_token
    fast = PreTrainedTokenizerFast(  # the special tokens as `build_tokenizer` declares them
        tokenizer_object=raw,
        eos_token=eos,
        pad_token=pad,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[t for t in base.all_special_tokens if t not in (eos, pad)],
    )
    fast.chat_template = base.chat_template
    if len(fast) != vocab_size:
        raise AssertionError(f"padded tokenizer has {len(fast)} tokens, not {vocab_size}")
    return fast


def build_shape_model(shape: str, path: Path, *, device: str | None = None,
                      max_position_embeddings: int | None = None) -> Path:
    """A random-init bf16 model of ``shape`` and its tokenizer at ``path`` (kept if built);
    ``max_position_embeddings`` overrides the card's (a `tiny_model` size: its default)."""
    if (path / "config.json").is_file():
        return path
    from palaestra.tiny_model import SIZES, build_model

    cards = model_cards()
    if shape in SIZES and shape not in cards:
        if max_position_embeddings is None:
            return build_model(path, shape)
        return build_model(path, shape, max_position_embeddings=max_position_embeddings)
    if shape not in cards and shape not in LEGACY_SHAPES:
        from palaestra.errors import ConfigError

        raise ConfigError(f"unknown shape {shape!r}: use one of {shape_names()}")
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if shape in LEGACY_SHAPES:
        from palaestra.tiny_model import build_tokenizer

        tokenizer = build_tokenizer()
        hidden, inter, layers, heads, kv = LEGACY_SHAPES[shape]
        fields: dict[str, Any] = {
            "vocab_size": -(-len(tokenizer) // 64) * 64, "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hidden // heads,
            "max_position_embeddings": 2048, "tie_word_embeddings": True, "rope_theta": 10000.0}
    else:
        card = dict(cards[shape])
        if card.get("model_type") != "qwen3":
            from palaestra.errors import ConfigError

            raise ConfigError(f"{shape!r} is a {card.get('model_type')} card; the benchmarks "
                              "build Qwen3 models")
        fields = {k: v for k, v in card.items() if k != "model_type"}
        tokenizer = padded_tokenizer(int(fields["vocab_size"]))
    if max_position_embeddings is not None:
        fields["max_position_embeddings"] = max_position_embeddings
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(path)
    config = Qwen3Config(
        **fields, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"), bos_token_id=None,
    )
    torch.manual_seed(0)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    with torch.device(device):  # a 1.7B init on CPU takes minutes
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]
    model.save_pretrained(path, safe_serialization=True)
    return path


def parameter_count(model_dir: Path) -> int:
    """Parameters of the model at ``model_dir`` (from its config.json, as HF counts them)."""
    from palaestra.trainers.megatron.arch import arch_from_hf_config
    from palaestra.trainers.megatron.flops import param_count

    hf = json.loads((Path(model_dir) / "config.json").read_text())
    return int(param_count(arch_from_hf_config(hf)).total)


def tokenizer_costs(model_dir: Path, *, decodes: int = 200, length: int = 256,
                    seed: int = 0) -> dict[str, float]:
    """What the tokenizer at ``model_dir`` costs: load (``load_tokenizer``, uncached), and
    decoding ``length`` random ids from the whole vocabulary (what a random-init model samples),
    median over ``decodes`` calls."""
    import random
    import statistics

    from transformers import PreTrainedTokenizerFast

    start = time.perf_counter()
    tok = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    load_s = time.perf_counter() - start
    rng = random.Random(seed)
    n = len(tok)
    times = []
    for _ in range(decodes):
        ids = [rng.randrange(n) for _ in range(length)]
        t = time.perf_counter()
        tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        times.append(time.perf_counter() - t)
    return {"vocab": float(n), "load_s": load_s,
            "decode_us_per_token": 1e6 * statistics.median(times) / length}


__all__ = ["LEGACY_SHAPES", "build_shape_model", "model_cards", "padded_tokenizer",
           "parameter_count", "shape_names", "tokenizer_costs"]

"""Hugging Face ``config.json`` fields of common policies (public model cards), keyed by
lower-case name: the shapes ``palaestra train --dry-run`` plans with when ``model.path`` holds no
checkpoint yet, and the GPU benchmarks' random-init models (`palaestra.tiny_model` builds the
small local ones)."""

from __future__ import annotations

from typing import Any

_QWEN2 = {"model_type": "qwen2", "vocab_size": 151936, "rope_theta": 1e6,
          "max_position_embeddings": 32768, "hidden_act": "silu"}
_QWEN3 = {"model_type": "qwen3", "vocab_size": 151936, "rope_theta": 1e6, "head_dim": 128,
          "max_position_embeddings": 40960, "hidden_act": "silu", "rms_norm_eps": 1e-6}

#: Hugging Face config.json fields of common policies (public model cards), keyed by lower-case
#: name; matched against ``model.path`` when it holds no config.json yet. The GPU benchmarks build
#: their random-init models from these too.
NAMED_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {**_QWEN2, "hidden_size": 896, "intermediate_size": 4864,
                     "num_hidden_layers": 24, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "tie_word_embeddings": True},
    "qwen2.5-1.5b": {**_QWEN2, "hidden_size": 1536, "intermediate_size": 8960,
                     "num_hidden_layers": 28, "num_attention_heads": 12,
                     "num_key_value_heads": 2, "tie_word_embeddings": True},
    "qwen2.5-3b": {**_QWEN2, "hidden_size": 2048, "intermediate_size": 11008,
                   "num_hidden_layers": 36, "num_attention_heads": 16,
                   "num_key_value_heads": 2, "tie_word_embeddings": True},
    "qwen2.5-7b": {**_QWEN2, "vocab_size": 152064, "hidden_size": 3584,
                   "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4,
                   "tie_word_embeddings": False},
    "qwen3-0.6b": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072,
                   "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-1.7b": {**_QWEN3, "hidden_size": 2048, "intermediate_size": 6144,
                   "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-4b": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728,
                 "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "tie_word_embeddings": False},
}


__all__ = ["NAMED_SHAPES"]

"""Megatron-core training backend: GPT models from HF configs, weight conversion, weight sync.

Light modules (no torch or megatron at import): ``arch`` (ModelArch from an HF config),
``config`` (MegatronBackendConfig), ``flops``. Pure tensor code that runs without megatron:
``convert`` / ``convert_moe`` (HF <-> Megatron names and layouts), ``sharding`` (TP/EP),
``attention_core`` (SDPA on Megatron layouts), ``logprobs`` (vocab-parallel logprobs). Needs
megatron-core (``pip install 'palaestra[megatron]'``, a CUDA machine): ``model``, ``parallel``,
``weights``, ``weight_sync``, ``backend`` (MegatronBackend).

Names are re-exported lazily, so ``from palaestra.trainers.megatron import ModelArch`` imports
neither torch nor megatron.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelArch": "arch",
    "MoEArch": "arch",
    "arch_from_hf_config": "arch",
    "padded_vocab_size": "arch",
    "MegatronBackendConfig": "config",
    "hf_to_mcore": "convert",
    "mcore_to_hf": "convert",
    "mcore_to_hf_param": "convert",
    "fuse_qkv": "convert",
    "split_qkv": "convert",
    "shard_state_dict": "sharding",
    "unshard_state_dicts": "sharding",
    "ep_shard_state_dict": "sharding",
    "ep_unshard_state_dicts": "sharding",
    "ParallelConfig": "parallel",
    "init_parallel": "parallel",
    "build_gpt_model": "model",
    "transformer_config": "model",
    "load_hf_weights": "weights",
    "iter_hf_weights": "weights",
    "sync_weights": "weight_sync",
    "module_copier": "weight_sync",
    "SyncStats": "weight_sync",
    "MegatronBackend": "backend",
    "train_flops_per_token": "flops",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)

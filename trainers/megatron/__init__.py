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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the lazy exports for type checkers; at run time `__getattr__` loads them
    from palaestra.trainers.megatron.arch import (
        ModelArch as ModelArch,
    )
    from palaestra.trainers.megatron.arch import (
        MoEArch as MoEArch,
    )
    from palaestra.trainers.megatron.arch import (
        arch_from_hf_config as arch_from_hf_config,
    )
    from palaestra.trainers.megatron.arch import (
        padded_vocab_size as padded_vocab_size,
    )
    from palaestra.trainers.megatron.backend import (
        MegatronBackend as MegatronBackend,
    )
    from palaestra.trainers.megatron.config import (
        MegatronBackendConfig as MegatronBackendConfig,
    )
    from palaestra.trainers.megatron.convert import (
        fuse_qkv as fuse_qkv,
    )
    from palaestra.trainers.megatron.convert import (
        hf_to_mcore as hf_to_mcore,
    )
    from palaestra.trainers.megatron.convert import (
        mcore_to_hf as mcore_to_hf,
    )
    from palaestra.trainers.megatron.convert import (
        mcore_to_hf_param as mcore_to_hf_param,
    )
    from palaestra.trainers.megatron.convert import (
        split_qkv as split_qkv,
    )
    from palaestra.trainers.megatron.flops import (
        train_flops_per_token as train_flops_per_token,
    )
    from palaestra.trainers.megatron.model import (
        build_gpt_model as build_gpt_model,
    )
    from palaestra.trainers.megatron.model import (
        transformer_config as transformer_config,
    )
    from palaestra.trainers.megatron.parallel import (
        ParallelConfig as ParallelConfig,
    )
    from palaestra.trainers.megatron.parallel import (
        init_parallel as init_parallel,
    )
    from palaestra.trainers.megatron.sharding import (
        ep_shard_state_dict as ep_shard_state_dict,
    )
    from palaestra.trainers.megatron.sharding import (
        ep_unshard_state_dicts as ep_unshard_state_dicts,
    )
    from palaestra.trainers.megatron.sharding import (
        shard_state_dict as shard_state_dict,
    )
    from palaestra.trainers.megatron.sharding import (
        unshard_state_dicts as unshard_state_dicts,
    )
    from palaestra.trainers.megatron.weight_sync import (
        SyncStats as SyncStats,
    )
    from palaestra.trainers.megatron.weight_sync import (
        module_copier as module_copier,
    )
    from palaestra.trainers.megatron.weight_sync import (
        sync_weights as sync_weights,
    )
    from palaestra.trainers.megatron.weights import (
        iter_hf_weights as iter_hf_weights,
    )
    from palaestra.trainers.megatron.weights import (
        load_hf_weights as load_hf_weights,
    )

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

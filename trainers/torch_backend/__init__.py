"""PyTorch training backend for Hugging Face causal LMs: CPU, CUDA (bf16) and FSDP2.

- ``config``: ``TorchBackendConfig`` (pydantic; imports no torch)
- ``backend``: ``TorchBackend`` with ``forward_logprobs``, ``train_step``,
  ``state_dict_for_engines``, ``save``/``load`` and ``export_hf``
- ``logprobs``: per-token logprobs/entropy from logits
- ``fused_logprobs``: the same from the last hidden states, chunked, without ``[T, V]`` logits
- ``kernels``: optional liger-kernel patches (CUDA) and the CPU bf16 autocast choice
- ``optim``: AdamW with warm-up and constant/linear/cosine schedules
- ``checkpoint``: checkpoint files and Hugging Face export
- ``distributed``: process group set-up and FSDP2 sharding

``TorchBackend`` and ``TorchBackendConfig`` are re-exported lazily: importing this package does
not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names for type checkers; at run time they load on first use
    from palaestra.trainers.torch_backend.backend import TorchBackend, seed_everything
    from palaestra.trainers.torch_backend.config import TorchBackendConfig

_EXPORTS = {
    "TorchBackend": "backend",
    "TorchBackendConfig": "config",
    "seed_everything": "backend",
}

__all__ = [
    "TorchBackend",
    "TorchBackendConfig",
    "seed_everything",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)

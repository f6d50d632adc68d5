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

Import ``TorchBackend`` from ``backend`` and ``TorchBackendConfig`` from ``config`` (which does
not import torch); this package exports nothing.
"""

from __future__ import annotations

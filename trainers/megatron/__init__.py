"""Megatron-core training backend: GPT models from HF configs, weight conversion, weight sync.

Light modules (no torch or megatron at import): ``arch`` (ModelArch from an HF config),
``config`` (MegatronBackendConfig), ``flops``. Pure tensor code that runs without megatron:
``convert`` / ``convert_moe`` (HF <-> Megatron names and layouts), ``sharding`` (TP/EP),
``logprobs`` (vocab-parallel logprobs). Needs
megatron-core (``pip install 'palaestra[megatron]'``, a CUDA machine): ``model``, ``parallel``,
``weights``, ``weight_sync``, ``backend`` (MegatronBackend).

Import names from their modules (``from palaestra.trainers.megatron.arch import ModelArch``
imports neither torch nor megatron); this package exports nothing.
"""

from __future__ import annotations

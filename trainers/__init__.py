"""Trainers, the learners: RL/SFT/DPO algorithms, training backends, batching, the trainer group.

The run around them (the loops, config, engines and weight sync) is `palaestra.run`; trainers
import neither it nor `palaestra.rollout` (samples arrive as core's `Sample`).

Subpackages are imported on demand and this module imports nothing heavy:

- ``palaestra.trainers.algorithms``: advantages, policy/value/KL/SFT/DPO losses (pure torch
  functions) and ``LossConfig`` (pydantic, torch-free).
- ``palaestra.trainers.batching``: ``TrainBatch`` and token-balanced, packed micro-batches.
- ``palaestra.trainers.torch_backend``: ``TorchBackend`` for Hugging Face causal LMs (CPU, CUDA,
  FSDP2).
"""

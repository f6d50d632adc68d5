"""AdamW and the learning-rate schedule (linear warm-up, then constant, linear or cosine).

The multiplier of the peak learning rate at optimizer step ``k`` (0-based; ``W`` warm-up steps,
``N`` total steps, ``m`` = ``min_lr_ratio``, ``p = (k - W) / (N - W)`` clamped to [0, 1])::

    k < W:     (k + 1) / W
    constant:  1
    linear:    1 - (1 - m) p
    cosine:    m + (1 - m) (1 + cos(pi p)) / 2
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from palaestra.trainers.torch_backend.config import TorchBackendConfig


def lr_multiplier(step: int, cfg: TorchBackendConfig) -> float:
    """Fraction of the peak learning rate used at optimizer step ``step`` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant" or cfg.total_steps is None:
        return 1.0
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, max(0.0, (step - cfg.warmup_steps) / span))
    m = cfg.min_lr_ratio
    if cfg.lr_schedule == "linear":
        return 1.0 - (1.0 - m) * progress
    return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: TorchBackendConfig
) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (``foreach`` kernels; fused on CUDA)."""
    trainable = [p for p in params if p.requires_grad]
    fused = bool(trainable) and trainable[0].is_cuda
    return torch.optim.AdamW(
        trainable,
        lr=cfg.lr,
        betas=cfg.adam_betas,
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        fused=fused or None,
    )


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TorchBackendConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` with ``lr_multiplier``; its state is the step count only."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))


__all__ = ["build_optimizer", "build_scheduler", "lr_multiplier"]

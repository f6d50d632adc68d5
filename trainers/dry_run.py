"""``palaestra train --dry-run``: the resolved config and the placement plan, nothing started."""

from __future__ import annotations

import json

from palaestra.trainers.config import TrainConfig


def describe_plan(cfg: TrainConfig) -> str:
    """A human-readable summary: what runs where, with the per-GPU memory estimate if any."""
    lines = [f"run directory: {cfg.out}", f"algorithm: {cfg.algorithm} (backend {cfg.trainer.backend})"]
    lines.append(f"model: {cfg.model.path}" + (f" (built locally: {cfg.model.init_size})"
                                                 if cfg.model.init_size else ""))
    if cfg.algorithm == "rl":
        r = cfg.rollout
        lines.append(
            f"rollout: {r.batch_size} prompts x {r.group_size} samples per step, {r.mode} mode, "
            f"{r.num_workers} workers ({r.cluster}), max {r.max_new_tokens} new tokens/turn"
        )
        lines.append(f"engine: {cfg.engine.kind}" + (f" at {', '.join(cfg.engine.urls)}"
                                                     if cfg.engine.urls else " (in process)"))
        if cfg.warmup.steps:
            lines.append(f"warm start: {cfg.warmup.steps} SFT steps on {cfg.warmup.demonstrations}")
    try:
        from palaestra.rollout.placement import describe_for_train_config

        lines.append(describe_for_train_config(cfg))
    except ImportError:  # placement planning is optional for CPU runs
        lines.append("placement: single process (CPU)")
    lines.append("resolved config:")
    lines.append(json.dumps(cfg.model_dump(), indent=2))
    return "\n".join(lines)

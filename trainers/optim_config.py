"""``OptimizerSettings``: the optimizer, schedule and micro-batching fields both backends share.

Torch-free (pydantic only). `TorchBackendConfig` and `MegatronBackendConfig` inherit them, so the
two backends read the same names with the same meaning and checks (``lr_multiplier`` in
``torch_backend.optim`` computes the schedule for both).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class OptimizerSettings(BaseModel):
    """Adam(W), the learning-rate schedule, gradient clipping and micro-batch token budgets."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    lr: float = Field(1e-6, gt=0.0)
    """Peak learning rate of Adam(W)."""

    weight_decay: float = Field(0.0, ge=0.0)
    """Decoupled weight decay."""

    adam_betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""

    adam_eps: float = Field(1e-8, gt=0.0)
    """Adam epsilon."""

    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up from 0 to ``lr`` over this many optimizer steps."""

    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate after warm-up: constant, or linear/cosine decay to ``min_lr_ratio * lr``."""

    total_steps: int | None = Field(None, gt=0)
    """Optimizer steps of the run (needed by the linear and cosine schedules)."""

    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Final learning rate of the decaying schedules, as a fraction of ``lr``."""

    max_grad_norm: float | None = Field(1.0, gt=0.0)
    """Clip the global gradient norm to this value (None: no clipping; the PyTorch backend
    still logs the norm, megatron-core then computes none)."""

    max_tokens_per_micro_batch: int = Field(8192, gt=0)
    """Token budget of one training micro-batch (padding included when not packing)."""

    forward_max_tokens_per_micro_batch: int | None = Field(None, gt=0)
    """Token budget of no-grad forwards (logprobs, values); default: twice the training one."""

    @model_validator(mode="after")
    def _check_schedule(self) -> OptimizerSettings:
        if self.lr_schedule != "constant" and self.total_steps is None:
            raise ValueError(
                f"lr_schedule={self.lr_schedule!r} decays over the run: set total_steps"
            )
        if self.total_steps is not None and self.warmup_steps > self.total_steps:
            raise ValueError("warmup_steps must not exceed total_steps")
        return self

    @property
    def forward_max_tokens(self) -> int:
        return self.forward_max_tokens_per_micro_batch or 2 * self.max_tokens_per_micro_batch


__all__ = ["OptimizerSettings"]

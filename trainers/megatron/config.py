"""``MegatronBackendConfig``: parallelism, precision, optimizer, schedule and batching.

Torch-free (pydantic only) so a command can validate it before importing torch or megatron.
The optimizer, schedule and batching fields mean what they mean in ``TorchBackendConfig``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class MegatronBackendConfig(BaseModel):
    """Settings of the megatron-core training backend."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    tp: int = Field(1, ge=1)
    """Tensor-parallel size (must divide the number of kv heads)."""

    pp: int = Field(1, ge=1)
    """Pipeline-parallel size."""

    ep: int = Field(1, ge=1)
    """Expert-parallel size (MoE models; must divide the number of experts)."""

    expert_tp: int | None = Field(None, ge=1)
    """Tensor-parallel size inside experts; None: same as ``tp``."""

    sequence_parallel: bool = False
    """Shard activations along the sequence in norms/dropout (needs tp > 1)."""

    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Model (compute) dtype; the optimizer keeps float32 master weights for bfloat16."""

    use_transformer_engine: Literal["auto", "on", "off"] = "auto"
    """TE layer spec when installed ("auto"), required ("on") or never ("off": SDPA spec)."""

    recompute: bool = False
    """Full activation recomputation of every layer (less memory, ~30% more compute)."""

    distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""

    ref_model: bool = False
    """Keep the initial weights as the reference policy (KL terms): this rank's shard in pinned
    CPU memory, swapped into the model for ``forward_logprobs(batch, ref=True)`` (no second
    model on the GPU; costs two host copies of the shard per reference forward)."""

    fused_swiglu: bool = False
    """Megatron's fused SwiGLU (``bias_activation_fusion``, compiled by torch): fewer kernels."""

    logits_temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature of the rollout: logits are divided by it before logprobs."""

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
    """Optimizer steps of the run (needed by the decaying schedules)."""

    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Final learning rate of the decaying schedules, as a fraction of ``lr``."""

    max_grad_norm: float | None = Field(1.0, gt=0.0)
    """Clip the global gradient norm to this value (None: no clipping)."""

    max_tokens_per_micro_batch: int = Field(8192, gt=0)
    """Token budget of one packed training micro-batch."""

    forward_max_tokens_per_micro_batch: int | None = Field(None, gt=0)
    """Token budget of no-grad forwards; default: twice the training one."""

    seed: int = 1234
    """Seed of the model-parallel RNGs and of random initialisation."""

    @model_validator(mode="after")
    def _check(self) -> MegatronBackendConfig:
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1")
        if self.lr_schedule != "constant" and self.total_steps is None:
            raise ValueError(
                f"lr_schedule={self.lr_schedule!r} decays over the run: set total_steps"
            )
        return self

    @property
    def forward_max_tokens(self) -> int:
        return self.forward_max_tokens_per_micro_batch or 2 * self.max_tokens_per_micro_batch


__all__ = ["MegatronBackendConfig"]

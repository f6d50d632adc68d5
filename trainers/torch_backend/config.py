"""``TorchBackendConfig``: device, precision, optimizer, schedule, batching and sharding.

Torch-free (pydantic only) so a command can validate it before importing torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TorchBackendConfig(BaseModel):
    """Settings of the PyTorch (Hugging Face) training backend."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    device: str = "auto"
    """"auto" (CUDA if available, else CPU), "cpu", "cuda" or "cuda:N". Ignored under
    torchrun with several processes: each rank uses cuda:LOCAL_RANK."""

    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype. "auto": bfloat16 on a CUDA device that supports it, else float32."""

    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the trained (master) weights and optimizer state."""

    attn_implementation: str | None = "sdpa"
    """Hugging Face attention implementation ("sdpa", "eager", "flash_attention_2", ...)."""

    trust_remote_code: bool = False
    """Allow model code from the checkpoint directory (custom architectures)."""

    critic: bool = False
    """Train a value model (token-classification head with one output) instead of a policy."""

    ref_model: bool = False
    """Keep a frozen reference copy for KL / DPO (``forward_logprobs(batch, ref=True)``)."""

    ref_model_path: str | None = None
    """Where the reference model is loaded from; default: the policy's ``model_path``."""

    logits_temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature of the rollout: logits are divided by it so that the trainer's
    logprobs match the engine's."""

    lr: float = Field(1e-6, gt=0.0)
    """Peak learning rate of AdamW."""

    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay (decoupled)."""

    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""

    adam_eps: float = Field(1e-8, gt=0.0)
    """AdamW epsilon."""

    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up from 0 to ``lr`` over this many optimizer steps."""

    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate after warm-up: constant, or linear/cosine decay to ``min_lr_ratio * lr``."""

    total_steps: int | None = Field(None, gt=0)
    """Optimizer steps of the run (needed by the linear and cosine schedules)."""

    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Final learning rate of the decaying schedules, as a fraction of ``lr``."""

    max_grad_norm: float | None = Field(1.0, gt=0.0)
    """Clip the global gradient norm to this value (None: no clipping, norm still logged)."""

    max_tokens_per_micro_batch: int = Field(8192, gt=0)
    """Token budget of one training micro-batch (padding included when not packing)."""

    forward_max_tokens_per_micro_batch: int | None = Field(None, gt=0)
    """Token budget of no-grad forwards (logprobs, values); default: twice the training one."""

    pack_sequences: bool = True
    """Pack several sequences per row (position ids restart per sequence); else right-pad."""

    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more compute)."""

    seed: int = 0
    """Seed of torch/python/numpy RNGs (value-head init, dropout if any)."""

    fsdp: Literal["auto", "off"] = "auto"
    """FSDP2 (``fully_shard``) over all ranks when the world size is > 1; "off" forbids it."""

    fsdp_reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (ZeRO-3); False keeps them (ZeRO-2)."""

    @model_validator(mode="after")
    def _check_schedule(self) -> TorchBackendConfig:
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


__all__ = ["TorchBackendConfig"]

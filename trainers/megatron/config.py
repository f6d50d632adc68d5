"""``MegatronBackendConfig``: parallelism, precision, optimizer, schedule and batching.

Torch-free (pydantic only) so a command can validate it before importing torch or megatron.
The optimizer, schedule and batching fields mean what they mean in ``TorchBackendConfig``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from palaestra.trainers.optim_config import OptimizerSettings


class MegatronBackendConfig(OptimizerSettings):
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

    critic: bool = False
    """Train a value model (PPO's critic): the LM head becomes a scalar value head (HF
    ``score``, initialised from a fixed seed unless the checkpoint has one); use
    ``forward_values`` and ``train_step`` with ``returns``/``old_values`` on the batch."""

    packed_attention: Literal["auto", "varlen", "per_sequence"] = "auto"
    """Attention over packs of several sequences: torch's varlen flash kernel (one launch per
    layer), or one causal SDPA call (cuDNN flash) per sequence, cut at host-side boundaries.
    "auto": per sequence for packs of up to 4 sequences (`palaestra.trainers.attention.PER_SEQUENCE_MAX`;
    measured 1.9x faster than varlen for a 4096-token sequence on an H200), varlen for more."""

    fused_swiglu: bool = False
    """Megatron's fused SwiGLU (``bias_activation_fusion``, compiled by torch): fewer kernels."""

    logits_temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature of the rollout: logits are divided by it before logprobs."""

    routing_replay: Literal["off", "rollout"] = "off"
    """MoE: route each token to the experts the rollout engine chose (``Sample.routed_experts``)
    through megatron-core's ``RouterReplay`` (`palaestra.trainers.routing_replay_megatron`);
    set from ``trainer.routing_replay``."""

    seed: int = 1234
    """Seed of the model-parallel RNGs and of random initialisation."""

    @model_validator(mode="after")
    def _check_parallel(self) -> MegatronBackendConfig:
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1")
        if self.critic and self.ref_model:
            raise ValueError("a critic has no reference policy: unset ref_model or critic")
        return self


def megatron_installed() -> bool:
    """Whether megatron-core can be imported here (looked up, not imported)."""
    import importlib.util

    try:  # megatron.core, not a folder that happens to be named megatron (e.g. a test package)
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        return False


__all__ = ["MegatronBackendConfig", "megatron_installed"]

"""``TorchBackendConfig``: device, precision, optimizer, schedule, batching and sharding.

Torch-free (pydantic only) so a command can validate it before importing torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from palaestra.trainers.optim_config import OptimizerSettings
from palaestra.trainers.torch_backend.lora import LoraSettings


class TorchBackendConfig(OptimizerSettings):
    """Settings of the PyTorch (Hugging Face) training backend."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    device: str = "auto"
    """"auto" (CUDA if available, else CPU), "cpu", "cuda" or "cuda:N". Ignored under
    torchrun with several processes: each rank uses cuda:LOCAL_RANK."""

    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype. "auto": bfloat16 on a CUDA device that supports it, else float32."""

    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the trained (master) weights and optimizer state."""

    attn_implementation: str | None = "auto"
    """Hugging Face attention implementation ("sdpa", "eager", "flash_attention_2", ...), or
    "varlen" (packed rows attend within each sequence through torch's variable-length flash
    kernel; per-sequence SDPA on CPU). "auto": "varlen" for packed rows on CUDA (measured 2.2x
    faster on an H200 train step of 256 ragged sequences), else "sdpa"."""

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

    pack_sequences: bool = True
    """Pack several sequences per row (position ids restart per sequence); else right-pad."""

    fused_logprobs: bool = True
    """Compute token logprobs and entropies from the last hidden states in chunks of
    ``logprob_chunk_tokens`` (lm_head matmul + float32 log-softmax per chunk, recomputed in the
    backward) instead of materialising ``[tokens, vocab]`` float32 logits. Used for the
    architectures whose output layer is a plain Linear (llama, mistral, qwen2/3, qwen3_moe,
    mixtral) and not under FSDP2; elsewhere the logits path runs."""

    logprob_chunk_tokens: int = Field(4096, ge=1)
    """Tokens per chunk of the fused logprob path (4096 x a 152k vocabulary: 2.5 GB float32)."""

    kernels: Literal["auto", "torch", "liger"] = "auto"
    """"liger": liger-kernel's Triton RMSNorm, RoPE and SwiGLU patched into the model (CUDA
    only; ``pip install 'palaestra[liger]'``; llama, mistral, qwen2, qwen3, qwen3_moe, mixtral).
    "torch": never. "auto": Liger on CUDA for the dense types where liger-kernel is installed
    (measured faster, logprobs within bf16 noise: ``benchmarks/perf/logprobs.py``), else torch."""

    cpu_autocast: Literal["auto", "bf16", "off"] = "auto"
    """On CPU with ``dtype = "auto"``: "bf16" runs forward/backward under bfloat16 autocast
    (float32 master weights and float32 log-softmax), "off" in float32. "auto": bf16 only where
    the CPU has AVX512-BF16/AMX and the model is big enough for it to measure faster
    (``benchmarks/perf/logprobs.py --cpu-autocast``)."""

    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more compute)."""

    seed: int = 0
    """Seed of torch/python/numpy RNGs (value-head init, dropout if any)."""

    fsdp: Literal["auto", "off"] = "auto"
    """FSDP2 (``fully_shard``) over all ranks when the world size is > 1; "off" forbids it."""

    fsdp_reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (ZeRO-3); False keeps them (ZeRO-2)."""

    lora: LoraSettings | None = None
    """``[trainer.torch.lora]``: train a peft LoRA adapter instead of the full weights (only the
    adapter is trained, checkpointed and synced to the engines; the reference model for KL is
    the same model with the adapter disabled). None: full fine-tuning."""

    routing_replay: Literal["off", "rollout"] = "off"
    """MoE policies: "rollout" forces the experts the rollout engine chose (the batch's
    ``routed_experts``) in every training forward; the router still learns through the softmax
    probabilities of those experts (`palaestra.trainers.routing_replay`)."""

    on_policy: Literal["default", "bitwise"] = "default"
    """"bitwise": the policy's logprobs come from the batch-invariant forward the embedded
    engine runs in the same mode (`palaestra.trainers.torch_backend.bitwise`), bit-equal to
    the rollout's; float32 on CPU, the engine's dtype (bfloat16) on CUDA; dense models,
    no LoRA, FSDP or critic (Liger's patches are bypassed: the forward reads the parameters).
    Set through ``trainer.on_policy``."""


__all__ = ["TorchBackendConfig"]

"""The shape of a Llama-family model (`DecoderConfig`, with a Qwen3-MoE model's sparse blocks:
`MoEConfig`) read from its Hugging Face config, and its rotary tables.

Shared by the embedded engine's decoders (`palaestra.engines.local.model`) and the torch
trainer's bitwise forward (`palaestra.trainers.torch_backend.bitwise`), which must build the
same fused layout from the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from palaestra.errors import EngineError

if TYPE_CHECKING:
    import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class MoEConfig:
    """Sparse-block shape of a Qwen3-MoE model (its Hugging Face config fields)."""

    num_experts: int
    top_k: int
    norm_topk_prob: bool
    moe_intermediate_size: int
    sparse_layers: tuple[int, ...]  # indices of the layers whose MLP is a sparse block

    @classmethod
    def from_hf(cls, hf: Any, num_layers: int) -> MoEConfig:
        experts = int(getattr(hf, "num_experts", 0) or 0)
        top_k = int(getattr(hf, "num_experts_per_tok", 0) or 0)
        if experts < 1 or not 1 <= top_k <= experts:
            raise EngineError(
                f"a qwen3_moe config needs num_experts >= 1 and 1 <= num_experts_per_tok <= "
                f"num_experts, got {experts} and {top_k}"
            )
        step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(hf, "mlp_only_layers", None) or ())
        sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        return cls(experts, top_k, bool(getattr(hf, "norm_topk_prob", False)),
                   int(hf.moe_intermediate_size), sparse)


@dataclass(frozen=True)
class DecoderConfig:
    """The shape of a Llama-family model, read from its Hugging Face config."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_positions: int
    tie_word_embeddings: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    moe: MoEConfig | None = None  # qwen3_moe: the sparse blocks (see `moe`)

    @classmethod
    def from_hf(cls, hf: Any) -> DecoderConfig:
        model_type = getattr(hf, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise EngineError(
                f"LocalEngine runs {', '.join(SUPPORTED_MODEL_TYPES)} models, not {model_type!r}; "
                "serve other architectures with SGLangEngine"
            )
        if getattr(hf, "use_sliding_window", False) and getattr(hf, "sliding_window", None):
            raise EngineError("sliding-window attention is not implemented by LocalEngine")
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        moe = MoEConfig.from_hf(hf, hf.num_hidden_layers) if model_type == "qwen3_moe" else None
        return cls(
            model_type=model_type,
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=hf.intermediate_size,
            vocab_size=hf.vocab_size,
            rms_norm_eps=hf.rms_norm_eps,
            max_positions=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            moe=moe,
        )


def signed_rope_tables(hf_config: Any, c: DecoderConfig, device: torch.device | str, dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin ``[max_positions, head_dim]``: ``rotate_half(x) * sin ==
    swap_halves(x) * sin_signed`` with the first half of sin negated (what the decoders and
    the trainer's bitwise forward apply)."""
    import torch

    cos, sin = rope_tables(hf_config, c, device, dtype)
    half = c.head_dim // 2
    return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def rope_tables(hf_config: Any, c: DecoderConfig, device: torch.device | str, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[max_positions, head_dim]`` from the model's own rotary-embedding class."""
    import importlib

    import torch

    module = importlib.import_module(f"transformers.models.{c.model_type}.modeling_{c.model_type}")
    rotary_cls = next(
        getattr(module, name) for name in dir(module) if name.endswith("RotaryEmbedding")
    )
    rotary = rotary_cls(config=hf_config)
    x = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        cos, sin = rotary(x, torch.arange(c.max_positions)[None])
    return cos[0].to(device=device, dtype=dtype), sin[0].to(device=device, dtype=dtype)


__all__ = ["SUPPORTED_MODEL_TYPES", "DecoderConfig", "MoEConfig", "rope_tables",
           "signed_rope_tables"]

"""Model architecture read off a Hugging Face config: the one description every other module uses.

`ModelArch` is a frozen, pure-Python record (no torch, no megatron) of the shapes and options that
decide both the Megatron model and the HF <-> Megatron weight layout. It supports the families the
backend can build: Qwen2, Qwen3 (q/k RMSNorm), Llama (including Llama-3 RoPE scaling), Qwen3-MoE
(softmax router, routed experts) and DeepSeek-V3 (multi-latent attention with YaRN RoPE, sigmoid
router with expert-bias and group-limited routing, a shared expert, dense first layers).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from palaestra.errors import ConfigError

SUPPORTED_FAMILIES = ("qwen2", "qwen3", "llama", "qwen3_moe", "deepseek_v3")


@dataclass(frozen=True)
class MoEArch:
    """Mixture-of-experts options: Qwen3-MoE (softmax router, aux loss) or DeepSeek-V3 (sigmoid
    router, expert bias, group-limited top-k, scaled weights, a shared expert)."""

    num_experts: int
    top_k: int
    ffn_hidden_size: int  # per expert
    norm_topk_prob: bool  # renormalise the top-k probabilities (Qwen3-MoE: True)
    aux_loss_coef: float
    layers: tuple[bool, ...]  # per decoder layer: True = MoE, False = dense MLP
    score_function: str = "softmax"  # "sigmoid" for DeepSeek-V3
    expert_bias: bool = False  # DeepSeek-V3's e_score_correction_bias (routing only)
    num_groups: int | None = None  # group-limited routing: experts in this many groups ...
    group_topk: int | None = None  # ... of which a token may use this many
    scaling_factor: float | None = None  # routed weights are multiplied by it
    shared_expert_ffn: int = 0  # width of the always-on shared expert (0: none)


@dataclass(frozen=True)
class MLAArch:
    """Multi-latent attention (DeepSeek-V2/V3): low-rank q and compressed kv with a shared
    rotary key part."""

    q_lora_rank: int | None  # None: a full-rank q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # HF rope_interleave: the rotary dims are stored pairwise

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class YarnRope:
    """YaRN RoPE scaling (DeepSeek-V3), as HF's rope_parameters / rope_scaling give it."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class ModelArch:
    """Decoder-only transformer shapes as the conversion and the model builder need them."""

    family: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int  # dense MLP width (unused by MoE layers)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    llama3_rope_factor: float | None = None  # Llama-3.x RoPE scaling factor, None if unscaled
    initializer_range: float = 0.02
    moe: MoEArch | None = None
    mla: MLAArch | None = None
    yarn: YarnRope | None = None  # only with MLA
    value_head: bool = False
    """A critic: the LM head is replaced by a scalar value head (HF ``score``, as in
    ``*ForTokenClassification`` with one label); set by the backend, not read off the config."""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def attention_dims(self) -> tuple[int, int]:
        """(query/key, value) head widths: both ``head_dim`` except under MLA."""
        if self.mla is not None:
            return self.mla.qk_head_dim, self.mla.v_head_dim
        return self.head_dim, self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.layers[layer]


def _as_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    raise ConfigError(
        f"expected a transformers PretrainedConfig or a config.json mapping, got {type(config)!r}"
    )


def _rope_source(cfg: Mapping[str, Any]) -> tuple[float, str | None, Mapping[str, Any]]:
    """(rope_theta, scaling type, scaling parameters) from the transformers-4 or -5 layout."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    source = params if params.get("rope_type") not in (None, "default") else scaling
    return float(theta), None if rope_type == "default" else rope_type, source


def _yarn(cfg: Mapping[str, Any]) -> tuple[float, YarnRope | None]:
    """(rope_theta, YaRN scaling or None) of a DeepSeek config."""
    theta, rope_type, source = _rope_source(cfg)
    if rope_type is None:
        return theta, None
    if rope_type != "yarn":
        raise ConfigError(f"RoPE scaling type {rope_type!r} is not supported with multi-latent "
                          "attention (supported: none, yarn)")
    if source.get("truncate") is False:
        raise ConfigError("yarn with truncate=False is not supported (megatron rounds the "
                          "correction range as DeepSeek does)")
    original = source.get("original_max_position_embeddings")
    if original is None:
        raise ConfigError("yarn RoPE scaling needs original_max_position_embeddings")
    return theta, YarnRope(
        factor=float(source["factor"]), original_max_position_embeddings=int(original),
        beta_fast=float(source.get("beta_fast") or 32.0),
        beta_slow=float(source.get("beta_slow") or 1.0),
        mscale=float(source.get("mscale") or 1.0),
        mscale_all_dim=float(source.get("mscale_all_dim") or 0.0),
    )


def _rope(cfg: Mapping[str, Any]) -> tuple[float, float | None]:
    """(rope_theta, llama3 factor) from either the transformers-4 or -5 config layout."""
    theta, rope_type, source = _rope_source(cfg)
    if rope_type is None:
        return float(theta), None
    if rope_type == "llama3":
        # megatron-core hard-codes the Llama-3.1 constants; refuse anything else rather than
        # silently building a model with other positions.
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}
        for key, value in expected.items():
            if float(source.get(key, value)) != value:
                raise ConfigError(
                    f"llama3 RoPE scaling with {key}={source.get(key)} is not supported by "
                    f"megatron-core (it fixes {key}={value}); use a model with the Llama-3.1 values"
                )
        return float(theta), float(source.get("factor", 8.0))
    raise ConfigError(
        f"RoPE scaling type {rope_type!r} is not supported by the Megatron backend "
        "(supported: none, llama3); remove rope_scaling or use the torch backend"
    )


def arch_from_hf_config(config: Any) -> ModelArch:
    """Read a `ModelArch` from a transformers config (object or config.json dict).

    Raises ConfigError for model types or options the Megatron backend cannot reproduce exactly
    (sliding-window attention, MLP/output biases, unknown RoPE scaling, shared experts).
    """
    cfg = _as_dict(config)
    family = cfg.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise ConfigError(
            f"model_type {family!r} is not supported by the Megatron backend; supported: "
            f"{', '.join(SUPPORTED_FAMILIES)}"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (only silu)")
    if cfg.get("use_sliding_window"):
        raise ConfigError("sliding-window attention is not supported; set use_sliding_window=False")
    if cfg.get("mlp_bias"):
        raise ConfigError("mlp_bias=True is not supported by the Megatron backend")
    if family == "deepseek_v3":
        return _deepseek_v3_arch(cfg)
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ConfigError(f"num_attention_heads={heads} is not a multiple of {kv_heads} kv heads")
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    attention_bias = bool(cfg.get("attention_bias", False))
    if family == "qwen2":
        qkv_bias = True  # Qwen2 always has q/k/v biases and no o_proj bias
    elif attention_bias:
        raise ConfigError(
            f"attention_bias=True on {family} also adds an o_proj bias, which the Megatron "
            "backend does not build; use attention_bias=False"
        )
    else:
        qkv_bias = False
    theta, llama3_factor = _rope(cfg)
    num_layers = int(cfg["num_hidden_layers"])
    moe = None
    if family == "qwen3_moe":
        sparse_step = int(cfg.get("decoder_sparse_step", 1))
        mlp_only = set(cfg.get("mlp_only_layers") or ())
        # config.json says num_experts; transformers-5's to_dict() says num_local_experts
        num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        if num_experts <= 0:
            raise ConfigError("a qwen3_moe config needs num_experts > 0")
        layers = tuple(
            (i not in mlp_only) and (i + 1) % sparse_step == 0 for i in range(num_layers)
        )
        moe = MoEArch(
            num_experts=num_experts,
            top_k=int(cfg["num_experts_per_tok"]),
            ffn_hidden_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
            layers=layers,
        )
    return ModelArch(
        family=family,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        ffn_hidden_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=family in ("qwen3", "qwen3_moe"),
        llama3_rope_factor=llama3_factor,
        initializer_range=float(cfg.get("initializer_range", 0.02)),
        moe=moe,
    )


def _deepseek_v3_moe(cfg: Mapping[str, Any], num_layers: int) -> MoEArch:
    num_experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg["num_experts_per_tok"])
    groups = int(cfg.get("n_group") or 1)
    group_topk = int(cfg.get("topk_group") or 1)
    if num_experts <= 0 or num_experts % groups:
        raise ConfigError(f"n_routed_experts={num_experts} must be > 0 and split into "
                          f"n_group={groups} groups")
    if groups > 1 and top_k // group_topk != 2:
        # HF scores a group by its top-2 experts; megatron by its top (top_k / topk_group)
        raise ConfigError(f"num_experts_per_tok / topk_group must be 2 with group-limited "
                          f"routing (got {top_k} / {group_topk}), as HF's router assumes")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"scoring_func {cfg.get('scoring_func')!r} is not supported (sigmoid)")
    if not cfg.get("norm_topk_prob", True) and top_k > 1:
        raise ConfigError("norm_topk_prob=False is not supported with sigmoid routing "
                          "(megatron always renormalises the top-k weights)")
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    return MoEArch(
        num_experts=num_experts, top_k=top_k, ffn_hidden_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=True, aux_loss_coef=0.0,  # DeepSeek-V3 balances by the expert bias
        layers=tuple(i >= first_dense and i % freq == 0 for i in range(num_layers)),
        score_function="sigmoid", expert_bias=True,
        num_groups=groups if groups > 1 else None,
        group_topk=group_topk if groups > 1 else None,
        scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        shared_expert_ffn=int(cfg.get("n_shared_experts") or 0) * int(cfg["moe_intermediate_size"]),
    )


def _deepseek_v3_arch(cfg: Mapping[str, Any]) -> ModelArch:
    """DeepSeek-V3 (and its small random variants): MLA + sigmoid-routed MoE."""
    if cfg.get("quantization_config"):
        raise ConfigError("quantized (fp8) DeepSeek checkpoints are not supported; dequantize "
                          "to bf16 first")
    if cfg.get("attention_bias"):
        raise ConfigError("attention_bias=True is not supported for DeepSeek-V3")
    heads = int(cfg["num_attention_heads"])
    num_layers = int(cfg["num_hidden_layers"])
    q_lora = cfg.get("q_lora_rank")
    mla = MLAArch(
        q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]), v_head_dim=int(cfg["v_head_dim"]),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
    )
    theta, yarn = _yarn(cfg)
    return ModelArch(
        family="deepseek_v3", vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]), ffn_hidden_size=int(cfg["intermediate_size"]),
        num_layers=num_layers, num_heads=heads, num_kv_heads=heads, head_dim=mla.v_head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), qk_norm=True,
        initializer_range=float(cfg.get("initializer_range", 0.02)),
        moe=_deepseek_v3_moe(cfg, num_layers), mla=mla, yarn=yarn,
    )


def padded_vocab_size(vocab_size: int, tp_size: int = 1, divisible_by: int = 1) -> int:
    """Vocabulary size Megatron allocates: rounded up to a multiple of divisible_by * tp_size.

    The default pads only as far as vocab-parallel sharding needs; padded rows are zeros and the
    logprob code masks their logits, so logprobs match the HF model exactly.
    """
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple

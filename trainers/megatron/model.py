"""Build a megatron-core `GPTModel` from a `ModelArch` (megatron is imported lazily, here only).

Layer spec: transformer-engine's when it is installed (fused kernels, packed sequences,
context parallelism), else megatron's local spec with its core attention replaced by
`SDPAttention` (torch SDPA / varlen flash), which keeps memory linear in sequence length.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import TYPE_CHECKING, Any

from palaestra.trainers.megatron.arch import ModelArch, padded_vocab_size
from palaestra.trainers.megatron.parallel import ParallelConfig, require_megatron

if TYPE_CHECKING:
    import torch


def transformer_engine_available() -> bool:
    """True when transformer-engine's torch extension can be imported."""
    return importlib.util.find_spec("transformer_engine") is not None


def transformer_config(
    arch: ModelArch,
    parallel: ParallelConfig | None = None,
    *,
    dtype: torch.dtype | None = None,
    use_cpu_initialization: bool = False,
    perform_initialization: bool = True,
    recompute: bool = False,
    **overrides: Any,
) -> Any:
    """A megatron `TransformerConfig` that reproduces the HF model's forward pass."""
    import torch
    import torch.nn.functional as F

    require_megatron()
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    dtype = dtype or torch.bfloat16
    parallel = parallel or ParallelConfig()
    kwargs: dict[str, Any] = {
        "num_layers": arch.num_layers,
        "hidden_size": arch.hidden_size,
        "ffn_hidden_size": arch.ffn_hidden_size,
        "num_attention_heads": arch.num_heads,
        "num_query_groups": arch.num_kv_heads,
        "kv_channels": arch.head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": arch.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": arch.qkv_bias,
        "qk_layernorm": arch.qk_norm,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "init_method_std": arch.initializer_range,
        "bias_activation_fusion": False,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
        "persist_layer_norm": False,
        "gradient_accumulation_fusion": False,
        "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "tensor_model_parallel_size": parallel.tp,
        "pipeline_model_parallel_size": parallel.pp,
        "expert_model_parallel_size": parallel.ep,
        "expert_tensor_parallel_size": parallel.expert_tp,
        "sequence_parallel": parallel.sequence_parallel,
        "use_cpu_initialization": use_cpu_initialization,
        "perform_initialization": perform_initialization,
        "variable_seq_lengths": True,  # packed micro-batches differ in length (PP shapes)
        "moe_token_dispatcher_type": "alltoall",  # the only dispatcher that allows that
        "cross_entropy_loss_fusion": False,
    }
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)
    if arch.moe is not None:
        kwargs.update(_moe_kwargs(arch))
    if arch.mla is not None:
        kwargs.update(_mla_kwargs(arch))
    kwargs.update(overrides)
    return (MLATransformerConfig if arch.mla is not None else TransformerConfig)(**kwargs)


def _moe_kwargs(arch: ModelArch) -> dict[str, Any]:
    moe = arch.moe
    assert moe is not None
    kwargs: dict[str, Any] = {
        "num_moe_experts": moe.num_experts,
        "moe_router_topk": moe.top_k,
        "moe_ffn_hidden_size": moe.ffn_hidden_size,
        "moe_layer_freq": [int(x) for x in moe.layers],
        "moe_router_load_balancing_type": "aux_loss" if moe.aux_loss_coef > 0 else "none",
        "moe_aux_loss_coeff": moe.aux_loss_coef,
        "moe_router_score_function": moe.score_function,
        "moe_grouped_gemm": False,
        "moe_router_dtype": "fp32",
    }
    if moe.score_function == "softmax":
        # Qwen3-MoE: softmax over all experts, then top-k, renormalised if norm_topk_prob.
        # Megatron's top-k-then-softmax equals the renormalised form; pre-softmax the other.
        kwargs["moe_router_pre_softmax"] = not moe.norm_topk_prob
    if moe.expert_bias:  # DeepSeek-V3's aux-loss-free balancing: the bias moves after each step
        kwargs["moe_router_enable_expert_bias"] = True
    if moe.num_groups:
        kwargs.update(moe_router_num_groups=moe.num_groups, moe_router_group_topk=moe.group_topk)
    if moe.scaling_factor is not None:
        kwargs["moe_router_topk_scaling_factor"] = moe.scaling_factor
    if moe.shared_expert_ffn:
        kwargs["moe_shared_expert_intermediate_size"] = moe.shared_expert_ffn
    return kwargs


def _mla_kwargs(arch: ModelArch) -> dict[str, Any]:
    mla = arch.mla
    assert mla is not None
    kwargs: dict[str, Any] = {
        "multi_latent_attention": True,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_head_dim": mla.qk_nope_head_dim,
        "qk_pos_emb_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "rotary_base": arch.rope_theta,
        "qk_layernorm": True,  # the q and kv latents' RMSNorms
        "num_query_groups": arch.num_heads,
    }
    if arch.yarn is None:
        # rotary_scaling_factor also scales the softmax (mscale): 1 means none
        kwargs.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    else:
        y = arch.yarn
        kwargs.update(rope_type="yarn", rotary_scaling_factor=y.factor,
                      original_max_position_embeddings=y.original_max_position_embeddings,
                      beta_fast=y.beta_fast, beta_slow=y.beta_slow, mscale=y.mscale,
                      mscale_all_dim=y.mscale_all_dim)
    return kwargs


def _with_sdpa_attention(layer_spec: Any) -> Any:
    from palaestra.trainers.megatron.sdpa_module import SDPAttention

    attn = layer_spec.submodules.self_attention
    attn_sub = dataclasses.replace(attn.submodules, core_attention=SDPAttention)
    layer_sub = dataclasses.replace(
        layer_spec.submodules, self_attention=dataclasses.replace(attn, submodules=attn_sub)
    )
    return dataclasses.replace(layer_spec, submodules=layer_sub)


def decoder_block_spec(
    config: Any, *, use_te: bool | None = None, vp_stage: int | None = None
) -> Any:
    """The decoder block spec of this pipeline stage (TE spec if available, else SDPA local)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if use_te is None:
        use_te = transformer_engine_available()
    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage
    )
    if not use_te:
        spec = dataclasses.replace(
            spec, layer_specs=[_with_sdpa_attention(s) for s in spec.layer_specs]
        )
    return spec


def build_gpt_model(
    arch: ModelArch,
    parallel: ParallelConfig | None = None,
    *,
    dtype: torch.dtype | None = None,
    use_te: bool | None = None,
    config: Any = None,
    **config_overrides: Any,
) -> Any:
    """A `GPTModel` for this rank (parallel groups must exist: see `init_parallel`).

    Its vocabulary is padded to a multiple of the TP size; logits of the padding are dropped by
    the logprob code. Pass ``config`` to reuse a TransformerConfig, else one is made from arch.
    """
    import torch

    require_megatron()
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    parallel = parallel or ParallelConfig()
    if config is None:
        config = transformer_config(
            arch, parallel, dtype=dtype, use_cpu_initialization=not torch.cuda.is_available(),
            **config_overrides,
        )
    spec = decoder_block_spec(config, use_te=use_te)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(arch.vocab_size, parallel.tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_embeddings and not arch.value_head,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=arch.rope_theta,
        rope_scaling=arch.llama3_rope_factor is not None,
        rope_scaling_factor=arch.llama3_rope_factor or 8.0,
    )
    if arch.value_head and model.post_process:
        from palaestra.trainers.megatron.value_head import ValueHead

        model.output_layer = ValueHead(arch.hidden_size, init_std=arch.initializer_range,
                                       dtype=config.params_dtype)
    # megatron's torch-norm wrapper creates fp32 weights whatever params_dtype says (megatron's
    # own training casts through Float16Module); mixed dtypes would miss the fused norm kernel.
    # Parameters only: buffers such as MoE token counters stay as they are.
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype != config.params_dtype:
                p.data = p.data.to(config.params_dtype)
    if not getattr(config, "apply_rope_fusion", False):  # the fused THD RoPE keeps its table
        from palaestra.trainers.megatron.packed_rope import install

        install(model)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model

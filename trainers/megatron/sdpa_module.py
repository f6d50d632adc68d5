"""Megatron core-attention module backed by torch SDPA, for layer specs without transformer-engine.

This module imports megatron-core at the top: import it only where megatron is installed (the
layer-spec builder does so lazily). The maths lives in `palaestra.trainers.attention`, which CPU tests cover.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from palaestra.errors import ConfigError
from palaestra.trainers.attention import sdpa_bshd, sdpa_thd, use_per_sequence


class SDPAttention(MegatronModule):
    """Drop-in for megatron's DotProductAttention: causal, GQA, packed ("thd") sequences.

    Unlike DotProductAttention it never materialises the [s, s] score matrix, so memory grows
    linearly with sequence length. Padding must be on the right or, better, sequences packed.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        **_: Any,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ConfigError(
                "SDPAttention does not implement context parallelism; install transformer-engine "
                "or set context_parallel_size=1"
            )
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ConfigError(f"SDPAttention only supports causal masks, got {attn_mask_type}")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        # set by MegatronBackend from its config (packed_attention)
        self.packed_attention = getattr(config, "palaestra_packed_attention", "varlen")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ConfigError("SDPAttention does not support attention_bias")
        dropout = self.dropout if self.training else 0.0
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            host = packed_seq_params.cu_seqlens_q_padded
            if host is not None and not host.is_cuda and use_per_sequence(
                    self.packed_attention, host.numel() - 1):
                return sdpa_thd(query, key, value, host, packed_seq_params.max_seqlen_q,
                                scale=self.softmax_scale, dropout_p=dropout, use_varlen=False)
            return sdpa_thd(
                query, key, value, packed_seq_params.cu_seqlens_q,
                packed_seq_params.max_seqlen_q, scale=self.softmax_scale, dropout_p=dropout,
            )
        if attention_mask is not None:
            raise ConfigError(
                "SDPAttention applies the causal mask itself: call the model with "
                "attention_mask=None and right padding, or pack sequences (PackedSeqParams)"
            )
        return sdpa_bshd(query, key, value, scale=self.softmax_scale, dropout_p=dropout)

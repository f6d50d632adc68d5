"""ModelArch from HF configs, parameter counts / FLOPs, backend config, and the light import."""

from __future__ import annotations

import subprocess
import sys

import pytest

from palaestra.errors import ConfigError
from palaestra.trainers.megatron.arch import arch_from_hf_config, padded_vocab_size
from palaestra.trainers.megatron.config import MegatronBackendConfig
from palaestra.trainers.megatron.flops import param_count, train_flops_per_token

QWEN3_06B = {  # config.json of Qwen/Qwen3-0.6B (shapes only)
    "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": True,
    "max_position_embeddings": 40960, "hidden_act": "silu",
}


@pytest.mark.parametrize("family,tie", [("qwen2", False), ("qwen3", True), ("llama", False),
                                        ("qwen3_moe", False)])
def test_param_count_matches_the_hf_model(hf_model_factory, family, tie):
    model = hf_model_factory(family, tie=tie)
    arch = arch_from_hf_config(model.config)
    assert arch.family == family
    assert param_count(arch).total == sum(p.numel() for p in model.parameters())


def test_qwen3_06b_shapes_and_flops():
    arch = arch_from_hf_config(QWEN3_06B)
    assert arch.qk_norm and not arch.qkv_bias and arch.tie_embeddings
    assert arch.rope_theta == 1e6 and arch.head_dim == 128
    count = param_count(arch)
    assert 0.59e9 < count.total < 0.61e9  # "Qwen3-0.6B": 596M parameters
    no_attn = train_flops_per_token(arch, 4096, attention=False)
    assert no_attn == 6 * count.matmul
    extra = train_flops_per_token(arch, 4096) - no_attn
    assert extra == pytest.approx(12 * 28 * 16 * 128 * 4097 / 2)


def test_transformers5_rope_parameters_and_llama3_scaling():
    cfg = dict(QWEN3_06B, model_type="llama", rope_theta=None,
               rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192})
    arch = arch_from_hf_config(cfg)
    assert arch.rope_theta == 500000.0 and arch.llama3_rope_factor == 32.0
    bad = dict(cfg, rope_parameters=dict(cfg["rope_parameters"], high_freq_factor=2.0))
    with pytest.raises(ConfigError, match="high_freq_factor"):
        arch_from_hf_config(bad)


@pytest.mark.parametrize("change,match", [
    ({"model_type": "gpt2"}, "not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"use_sliding_window": True}, "sliding"),
    ({"attention_bias": True}, "o_proj"),
    ({"num_key_value_heads": 3}, "multiple"),
])
def test_unsupported_configs_are_refused_with_a_reason(change, match):
    with pytest.raises(ConfigError, match=match):
        arch_from_hf_config(dict(QWEN3_06B, **change))


def test_padded_vocab():
    assert padded_vocab_size(151936, 1) == 151936
    assert padded_vocab_size(151937, 4) == 151940
    assert padded_vocab_size(50257, 1, divisible_by=128) == 50304


def test_backend_config_validates():
    assert MegatronBackendConfig().forward_max_tokens == 16384
    with pytest.raises(ValueError, match="sequence_parallel"):
        MegatronBackendConfig(sequence_parallel=True)
    with pytest.raises(ValueError):
        MegatronBackendConfig(tp=0)


def test_light_modules_import_neither_torch_nor_megatron():
    code = (
        "import sys\n"
        "from palaestra.trainers.megatron.arch import ModelArch\n"
        "from palaestra.trainers.megatron.config import MegatronBackendConfig\n"
        "from palaestra.trainers.megatron import arch, config, flops\n"
        "heavy = [m for m in ('torch', 'megatron', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

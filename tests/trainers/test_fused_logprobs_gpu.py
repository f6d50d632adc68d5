"""The fused logprob path and Liger's kernels on one CUDA GPU (skipped without CUDA).

Run on a GPU machine with ``python -m pytest tests/trainers/test_fused_logprobs_gpu.py -m gpu``
(the Liger test also needs ``liger-kernel``; it skips without it).
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest
import torch

from palaestra.trainers.algorithms.config import LossConfig
from palaestra.trainers.batching import TrainBatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB = 32_000  # big enough that the logits dominate the head's memory


def qwen3(path: Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=1024, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    return path


def make_batch(n: int = 24, length: int = 200) -> TrainBatch:
    g = torch.Generator().manual_seed(1)
    ids, masks, adv = [], [], []
    for i in range(n):
        ids.append(torch.randint(0, VOCAB, (length,), generator=g))
        mask = torch.tensor([0.0] * 20 + [1.0] * (length - 20))
        masks.append(mask)
        adv.append(mask * (1.0 if i % 2 else -1.0))
    return TrainBatch(token_ids=ids, loss_mask=masks, advantages=adv,
                      group_ids=[f"p{i // 4}" for i in range(n)])


def _run(model_dir: Path, batch: TrainBatch, **settings):
    from palaestra.trainers.torch_backend.backend import TorchBackend
    from palaestra.trainers.torch_backend.config import TorchBackendConfig

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    backend = TorchBackend(model_dir, TorchBackendConfig(device="cuda", lr=1e-4, **settings))
    logps = backend.forward_logprobs(batch)
    metrics = backend.train_step(batch, LossConfig(preset="grpo", entropy_coef=0.01))
    peak = torch.cuda.max_memory_allocated()
    return backend, logps, metrics, peak


def _gap(a, b) -> tuple[float, float]:
    d = torch.cat([(x - y).abs()[1:] for x, y in zip(a, b)])
    return float(d.max()), float(d.mean())


def test_fused_matches_logits_on_cuda_with_less_memory(tmp_path: Path) -> None:
    model_dir = qwen3(tmp_path / "m")
    batch = make_batch()
    _, lp_logits, m_logits, peak_logits = _run(model_dir, batch, fused_logprobs=False,
                                               kernels="torch")
    _, lp_fused, m_fused, peak_fused = _run(model_dir, batch, fused_logprobs=True,
                                            kernels="torch", logprob_chunk_tokens=1024)
    gap_max, _ = _gap(lp_fused, lp_logits)
    assert gap_max < 1e-3  # the same bf16 products, float32 after them
    assert m_fused["loss"] == pytest.approx(m_logits["loss"], rel=1e-3, abs=1e-5)
    assert m_fused["grad_norm"] == pytest.approx(m_logits["grad_norm"], rel=1e-2)
    assert peak_fused < peak_logits, (peak_fused, peak_logits)


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None,
                    reason="needs liger-kernel")
def test_liger_kernels_within_bf16_noise(tmp_path: Path) -> None:
    model_dir = qwen3(tmp_path / "m")
    batch = make_batch(n=8)
    _, lp_fp32, _, _ = _run(model_dir, batch, dtype="float32", kernels="torch")
    _, lp_bf16, _, _ = _run(model_dir, batch, kernels="torch")
    liger, lp_liger, metrics, _ = _run(model_dir, batch, kernels="liger")
    assert liger.kernels == "liger"
    names = {type(m).__name__ for m in liger.model.modules()} | {
        m._get_name() for m in liger.model.modules()}
    assert "LigerSwiGLUMLP" in names
    torch_gap = _gap(lp_bf16, lp_fp32)
    liger_gap = _gap(lp_liger, lp_fp32)
    # Liger's bf16 kernels are as far from float32 as torch's bf16 modules are (or closer)
    assert liger_gap[1] <= 2 * torch_gap[1] + 1e-3, (liger_gap, torch_gap)
    assert all(math.isfinite(v) for v in metrics.values())
    # the module-level classes were put back: a later plain model of this type is untouched
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(str(model_dir))
    assert not any("Liger" in m._get_name() for m in plain.modules())

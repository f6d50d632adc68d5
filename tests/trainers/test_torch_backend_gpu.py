"""TorchBackend on one CUDA GPU: bf16 logprobs, training and checkpoints (skipped without CUDA).

Run on a GPU machine with ``python -m pytest tests/trainers/test_torch_backend_gpu.py -m gpu``.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from palaestra.trainers.algorithms.config import LossConfig
from palaestra.trainers.batching import TrainBatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

torch.set_num_threads(1)


def tiny_qwen3(path: Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    return path


def make_batch(seed: int = 1, n: int = 9) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids, masks, adv = [], [], []
    for i in range(n):
        length = 6 + (i * 5) % 14
        ids.append(torch.randint(0, 300, (length,), generator=g))
        mask = torch.tensor([0.0] * 3 + [1.0] * (length - 3))
        masks.append(mask)
        adv.append(mask * (1.0 if i % 2 else -1.0))
    return TrainBatch(token_ids=ids, loss_mask=masks, advantages=adv,
                      group_ids=[f"p{i // 3}" for i in range(n)])


def test_cuda_bf16_logprobs_training_and_roundtrip(tmp_path):
    from palaestra.trainers.torch_backend.backend import TorchBackend
    from palaestra.trainers.torch_backend.config import TorchBackendConfig

    model_dir = tiny_qwen3(tmp_path / "model")
    gpu = TorchBackend(model_dir, TorchBackendConfig(device="cuda", lr=1e-2))
    assert gpu.compute_dtype == torch.bfloat16 and gpu.device.type == "cuda"
    cpu = TorchBackend(model_dir, TorchBackendConfig(device="cpu"))
    batch = make_batch()
    for x, y in zip(gpu.forward_logprobs(batch), cpu.forward_logprobs(batch)):
        assert x.device.type == "cpu"
        torch.testing.assert_close(x, y, atol=0.05, rtol=0)  # bf16 matmuls, fp32 softmax
    cfg = LossConfig.from_preset("sft")
    losses = [gpu.train_step(batch, cfg)["loss"] for _ in range(4)]
    assert all(a > b for a, b in itertools.pairwise(losses)), losses
    gpu.save(tmp_path / "ckpt")
    expected = gpu.train_step(batch, cfg)
    again = TorchBackend(model_dir, TorchBackendConfig(device="cuda", lr=1e-2))
    again.load(tmp_path / "ckpt")
    got = again.train_step(batch, cfg)
    assert got["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    sd = gpu.state_dict_for_engines(dtype=torch.bfloat16)
    assert all(t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in sd.values())

"""TorchBackend with ``attn_implementation = "varlen"``: packed rows attend within each sequence.

On CPU the varlen path runs one SDPA call per packed sequence (the CUDA varlen kernel is checked
against it in the Megatron GPU tests); here the whole HF plumbing is checked: the registered
attention and mask functions, the cumulative lengths handed down through the model's kwargs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from palaestra.errors import ConfigError
from palaestra.trainers.algorithms.config import LossConfig
from palaestra.trainers.torch_backend.backend import TorchBackend
from palaestra.trainers.torch_backend.config import TorchBackendConfig
from tests.trainers.test_torch_backend import make_batch, tiny_qwen3

pytestmark = pytest.mark.numerics  # packed (varlen) attention against padded rows

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_varlen"))


def _backend(model_dir: Path, **kwargs: object) -> TorchBackend:
    return TorchBackend(model_dir, TorchBackendConfig(device="cpu", **kwargs))


def test_varlen_logprobs_and_step_match_padded_rows(model_dir: Path) -> None:
    batch = make_batch(n=7)
    padded = _backend(model_dir, pack_sequences=False)
    varlen = _backend(model_dir, pack_sequences=True, attn_implementation="varlen",
                      max_tokens_per_micro_batch=64)
    for a, b in zip(padded.forward_logprobs(batch), varlen.forward_logprobs(batch)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    cfg = LossConfig(preset="grpo", entropy_coef=0.01)
    m_pad = padded.train_step(batch, cfg)
    m_var = varlen.train_step(batch, cfg)
    assert m_var["num_micro_batches"] > 1  # several packed rows of several sequences each
    assert m_var["loss"] == pytest.approx(m_pad["loss"], rel=1e-5, abs=1e-7)
    assert m_var["grad_norm"] == pytest.approx(m_pad["grad_norm"], rel=1e-4)
    for a, b in zip(padded.forward_logprobs(batch), varlen.forward_logprobs(batch)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_varlen_refuses_padded_rows(model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="pack_sequences"):
        _backend(model_dir, pack_sequences=False, attn_implementation="varlen")


def test_auto_attention_is_varlen_for_packed_rows_on_cuda_only() -> None:
    from palaestra.trainers.torch_backend.backend import VARLEN, resolve_attn_implementation

    assert resolve_attn_implementation("auto", "cuda", packed=True) == VARLEN
    assert resolve_attn_implementation("auto", "cuda", packed=False) == "sdpa"
    assert resolve_attn_implementation("auto", "cpu", packed=True) == "sdpa"
    assert resolve_attn_implementation("eager", "cuda", packed=True) == "eager"
    assert resolve_attn_implementation(None, "cuda", packed=True) is None

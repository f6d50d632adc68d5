"""The fused logprob path (hidden states -> chunked lm_head -> float32 log-softmax) on CPU.

It must give the logits path's logprobs, entropies and gradients (float32, within 1e-5), skip
the ``[T, V]`` logits in the backend, and the CPU bf16 autocast switch must resolve as
documented and stay within its measured logprob tolerance.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from palaestra.errors import ConfigError
from palaestra.engines.local.sampling import token_logprobs as engine_token_logprobs
from palaestra.trainers.algorithms.config import LossConfig
from palaestra.trainers.batching import TrainBatch
from palaestra.trainers.torch_backend.backend import TorchBackend
from palaestra.trainers.torch_backend.config import TorchBackendConfig
from palaestra.trainers.torch_backend.fused_logprobs import (
    _LinearLogprobs,
    linear_token_logprobs,
    shifted_linear_logprobs,
)
from palaestra.trainers.torch_backend.kernels import (
    CPU_BF16_MIN_HIDDEN,
    cpu_autocast_dtype,
    cpu_has_bf16,
)
from palaestra.trainers.torch_backend.logprobs import shifted_token_logprobs, token_logprobs

pytestmark = pytest.mark.numerics  # fused logprob kernels against the plain formula

torch.set_num_threads(1)


def tiny_qwen3(path: Path, hidden: int = 64) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=300, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
        max_position_embeddings=512, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3(tmp_path_factory.mktemp("fused_qwen3"))


def make_batch(n: int = 6) -> TrainBatch:
    g = torch.Generator().manual_seed(3)
    ids, masks, adv, rollout = [], [], [], []
    for i in range(n):
        length = 8 + (i * 7) % 15
        ids.append(torch.randint(0, 300, (length,), generator=g))
        mask = torch.tensor([0.0] * 3 + [1.0] * (length - 3))
        masks.append(mask)
        adv.append(mask * (1.0 if i % 2 else -1.0))
        rollout.append(mask * -5.7)
    return TrainBatch(token_ids=ids, loss_mask=masks, advantages=adv, rollout_logprobs=rollout,
                      group_ids=[f"p{i // 3}" for i in range(n)])


def _inputs(dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(0)
    R, L, H, V = 3, 11, 16, 97
    h = (torch.randn(R, L, H, generator=g) * 2).to(dtype).requires_grad_(True)
    w = torch.randn(V, H, generator=g).to(dtype).requires_grad_(True)
    ids = torch.randint(0, V, (R, L), generator=g)
    valid = torch.ones(R, L, dtype=torch.bool)
    valid[:, 0] = False
    valid[1, 7:] = False  # padding
    valid[2, 5] = False  # a packed row's second sequence starts here
    return h, w, ids, valid


#: A float32 log-softmax over V logits is exact to a few ulps of its largest input whatever the
#: order of its sums; the chunked logsumexp and the full one (or one CPU's vector width and
#: another's) agree to that, not to a fixed 1e-5 (1.14e-5 at a logprob of -32 was seen).
FP32_ULPS = 8


def fp32_log_softmax_tol(h: torch.Tensor, w: torch.Tensor, temperature: float) -> dict:
    """`assert_close` tolerances for log-softmax outputs of the logits ``h @ w.T / T``."""
    scale = float((h.detach() @ w.detach().t()).abs().max()) / temperature
    return {"atol": FP32_ULPS * torch.finfo(torch.float32).eps * scale, "rtol": 0.0}


def _materialised(h: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor,
                  temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain formula: whole float32 logits, log_softmax, gather (the former path)."""
    logp = torch.log_softmax((h @ w.t()).float()[:, :-1] / temperature, dim=-1)
    lp = logp.gather(-1, ids[:, 1:, None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    zeros = lp.new_zeros(lp.shape[0], 1)
    return (torch.where(valid, torch.cat([zeros, lp], 1), 0.0),
            torch.where(valid, torch.cat([zeros, ent], 1), 0.0))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logits_path_equals_the_plain_formula(temperature: float) -> None:
    h, w, ids, valid = _inputs()
    weights = torch.linspace(-1.0, 2.0, ids.shape[1])
    ref = _materialised(h, w, ids, valid, temperature)
    got = shifted_token_logprobs(h @ w.t(), ids, valid, with_entropy=True,
                                 temperature=temperature)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **fp32_log_softmax_tol(h, w, temperature))
    for a, b in zip(torch.autograd.grad((got[0] * weights).sum() + got[1].sum(), (h, w)),
                    torch.autograd.grad((ref[0] * weights).sum() + ref[1].sum(), (h, w))):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 4, 4096])
def test_fused_equals_logits_path(temperature: float, chunk: int) -> None:
    h, w, ids, valid = _inputs()
    weights = torch.linspace(-1.0, 2.0, ids.shape[1])
    ref_lp, ref_ent = _materialised(h, w, ids, valid, temperature)
    lp, ent = shifted_linear_logprobs(h, w, ids, valid, with_entropy=True,
                                      temperature=temperature, chunk_tokens=chunk)
    assert lp.dtype == torch.float32 and lp.shape == ids.shape
    tol = fp32_log_softmax_tol(h, w, temperature)
    assert tol["atol"] < 1e-4  # still a tight bound at this test's logit scale
    torch.testing.assert_close(lp, ref_lp, **tol)
    torch.testing.assert_close(ent, ref_ent, **tol)
    assert float(lp.detach()[~valid].abs().max()) == 0.0
    assert float(ent.detach()[~valid].abs().max()) == 0.0

    def grads(a: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, ...]:
        loss = (a * weights).sum() + 0.3 * (e * weights.flip(0)).sum()
        return torch.autograd.grad(loss, (h, w))

    for got, want in zip(grads(lp, ent), grads(ref_lp, ref_ent)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_entropy_as_metric_only_gives_the_logprob_gradient() -> None:
    h, w, ids, valid = _inputs()
    lp, ent = shifted_linear_logprobs(h, w, ids, valid, with_entropy=True, chunk_tokens=5)
    ref_lp, _ = shifted_token_logprobs(h @ w.t(), ids, valid)
    got = torch.autograd.grad(lp.sum() + ent.detach().sum(), (h, w))
    want = torch.autograd.grad(ref_lp.sum(), (h, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_gradcheck_in_float64_with_bias_and_temperature() -> None:
    g = torch.Generator().manual_seed(1)
    h = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, 5, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(9, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 3, 8, 1, 1, 6, 2])
    assert torch.autograd.gradcheck(
        lambda x, y, z: _LinearLogprobs.apply(x, y, z, targets, 1 / 0.8, True, 3), (h, w, b))


def test_temperature_matches_the_engines_sampling_logprobs() -> None:
    h, w, ids, _ = _inputs()
    flat_h, flat_ids = h.detach().reshape(-1, h.shape[-1]), ids.reshape(-1)
    for t in (1.0, 0.6, 1.3):
        want = engine_token_logprobs(flat_h @ w.detach().t(), flat_ids, temperature=t)
        got, _ = linear_token_logprobs(flat_h, w.detach(), flat_ids, temperature=t,
                                       chunk_tokens=8)
        # chunked against whole GEMMs: a few float32 ulps of logprobs near -40 (relative)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(got, token_logprobs(flat_h @ w.detach().t(), flat_ids,
                                                       temperature=t)[0], atol=1e-5, rtol=1e-6)


def test_bfloat16_autocast_matmul_matches_the_autocast_logits_path() -> None:
    h, w, ids, valid = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_lp, ref_ent = shifted_token_logprobs(torch.nn.functional.linear(h, w), ids, valid,
                                                 with_entropy=True)
        lp, ent = shifted_linear_logprobs(h, w, ids, valid, with_entropy=True, chunk_tokens=4)
    assert lp.dtype == torch.float32
    # the same bf16 products, then float32 on both sides: only summation order differs
    torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-4, rtol=0)


def test_bad_chunk_size_is_refused() -> None:
    h, w, ids, _ = _inputs()
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_token_logprobs(h[0], w, ids[0], chunk_tokens=0)


def _lm_head_calls(backend: TorchBackend) -> list[int]:
    calls = [0]
    head = backend.model.get_output_embeddings()
    head.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("pack", [True, False])
def test_backend_fused_equals_logits_path(model_dir: Path, pack: bool) -> None:
    batch = make_batch()
    cfg = LossConfig(preset="grpo", entropy_coef=0.01)
    results = {}
    for fused in (False, True):
        backend = TorchBackend(model_dir, TorchBackendConfig(
            device="cpu", lr=1e-3, fused_logprobs=fused, logprob_chunk_tokens=16,
            pack_sequences=pack, logits_temperature=0.9))
        calls = _lm_head_calls(backend)
        lp, ent = backend.forward_logprobs_with_entropy(batch)
        metrics = [backend.train_step(batch, cfg) for _ in range(2)]
        results[fused] = (lp, ent, metrics, dict(backend.model.named_parameters()))
        assert (calls[0] == 0) == fused  # the fused path never runs the output layer
    (lp0, ent0, m0, p0), (lp1, ent1, m1, p1) = results[False], results[True]
    for a, b in zip(lp0 + ent0, lp1 + ent1):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for a, b in zip(m0, m1):
        for key in ("loss", "grad_norm", "actor/entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    for name in p0:
        torch.testing.assert_close(p0[name], p1[name], atol=1e-5, rtol=0)


def test_cpu_autocast_resolution(tmp_path: Path) -> None:
    small = tiny_qwen3(tmp_path / "small", hidden=64)
    assert cpu_autocast_dtype("off", small) == torch.float32
    assert cpu_autocast_dtype("bf16", small) == torch.bfloat16
    assert cpu_autocast_dtype("auto", small) == torch.float32  # too small to gain (measured)
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text(json.dumps({"hidden_size": CPU_BF16_MIN_HIDDEN}))
    want = torch.bfloat16 if cpu_has_bf16() else torch.float32
    assert cpu_autocast_dtype("auto", big) == want


def test_cpu_bf16_autocast_logprobs_within_tolerance(model_dir: Path) -> None:
    batch = make_batch()
    lps = {}
    for mode in ("off", "bf16"):
        backend = TorchBackend(model_dir, TorchBackendConfig(device="cpu", cpu_autocast=mode))
        assert backend.compute_dtype == (torch.bfloat16 if mode == "bf16" else torch.float32)
        lps[mode] = torch.cat([lp[1:] for lp in backend.forward_logprobs(batch)])
        metrics = backend.train_step(batch, LossConfig(preset="grpo"))
        assert all(math.isfinite(v) for v in metrics.values())
    gap = (lps["bf16"] - lps["off"]).abs()
    # measured on the tiny/small/10m models: mean 1e-3..3e-3, max 4e-3..1.3e-2
    assert 0 < float(gap.mean()) < 1e-2 and float(gap.max()) < 5e-2


def test_liger_kernels_refused_on_cpu(model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="CUDA"):
        TorchBackend(model_dir, TorchBackendConfig(device="cpu", kernels="liger"))
    # "auto" on CPU quietly keeps the torch modules
    assert TorchBackend(model_dir, TorchBackendConfig(device="cpu")).kernels == "torch"


def test_megatron_vocab_parallel_logprobs_chunked_gradients() -> None:
    from palaestra.trainers.megatron.logprobs import vocab_parallel_logprobs

    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(2, 9, 15, generator=g) * 4).requires_grad_(True)
    labels = torch.randint(0, 13, (2, 9), generator=g)  # 13 real tokens + 2 padding columns
    wl, we = torch.randn(2, 9, generator=g), torch.randn(2, 9, generator=g)
    ref = torch.log_softmax(logits[..., :13].double(), -1)
    ref_lp = ref.gather(-1, labels[..., None])[..., 0]
    ref_ent = -(ref.exp() * ref).sum(-1)
    ref_grad = torch.autograd.grad((ref_lp * wl).sum() + (ref_ent * we).sum(), logits)[0].double()
    for rows in (1, 4, 4096):
        lp, ent = vocab_parallel_logprobs(logits, labels, vocab_size=13, with_entropy=True,
                                          chunk_rows=rows)
        torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
        grad = torch.autograd.grad((lp * wl).sum() + (ent * we).sum(), logits)[0]
        torch.testing.assert_close(grad.double(), ref_grad, atol=1e-5, rtol=0)
        assert float(grad[..., 13:].abs().max()) == 0.0  # padding columns get no gradient


def test_a_process_held_to_avx2_chooses_float32_as_a_cpu_without_bf16_would(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Held to AVX2 (the AVX2 pass, docs/results.md's AVX2 runs), torch emulates bf16 matmuls;
    ``auto`` must pick what a CPU without AVX512-BF16/AMX picks, whatever this CPU has."""
    assert not cpu_has_bf16({"ATEN_CPU_CAPABILITY": "avx2"})
    assert not cpu_has_bf16({"ONEDNN_MAX_CPU_ISA": "AVX2"})
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text(json.dumps({"hidden_size": CPU_BF16_MIN_HIDDEN}))
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert cpu_autocast_dtype("auto", big) == torch.float32
    assert cpu_autocast_dtype("bf16", big) == torch.bfloat16  # asked for explicitly: kept

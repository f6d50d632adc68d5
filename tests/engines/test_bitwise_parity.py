"""The full-vocabulary parity check and LoRA in bitwise on-policy mode, on the tiny model (CPU).

In bitwise mode the embedded engine's full next-token distributions (its re-run forward and its
sampler's log-softmax, `palaestra.engines.local.parity`) equal the torch backend's at every
position, every vocabulary entry, bit for bit: the largest log-probability difference and the
total-variation distance are exactly 0, and the engine's re-run gives each sampled token the
logprob it reported while sampling. With a LoRA adapter trained on the trainer's side and pushed
to the engine (merged on both sides by one function) the same holds, and the sampled tokens'
logprobs agree exactly too. In the default mode, a trainer computing in bfloat16 against a
float32 engine, the check reports a gap (a dtype difference, not a property of the host's
kernels, so the premise holds on any CPU). The GPU twin of the run-level check is
``tests/run/test_bitwise_run_gpu.py``.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import torch

TEMPERATURE = 0.8


async def _sample_and_score(engine: Any, count: int = 6, seed: int = 0
                            ) -> tuple[list[list[int]], list[list[int]], list[list[float]],
                                       list[torch.Tensor]]:
    """Sample ``count`` requests together; then the engine's full distributions at every
    sampled position of each. Returns (sequences, sampled positions, reported logprobs,
    engine [positions, V] per sequence)."""
    from palaestra.engine import SamplingParams
    from palaestra.engines.local.parity import FullLogprobsRequest

    rng = random.Random(seed)
    prompts = [[rng.randrange(5, 700) for _ in range(rng.randrange(3, 40))] for _ in range(count)]
    params = SamplingParams(max_new_tokens=12, temperature=TEMPERATURE, ignore_eos=True)
    gens = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    seqs = [list(p) + list(g.token_ids) for p, g in zip(prompts, gens)]
    positions = [list(range(len(p), len(s))) for p, s in zip(prompts, seqs)]
    full = [await engine.full_logprobs(FullLogprobsRequest.of(s, pos, TEMPERATURE))
            for s, pos in zip(seqs, positions)]
    return seqs, positions, [list(g.logprobs) for g in gens], full


def _run(coro_fn: Any, model_dir: str, **engine_kwargs: Any) -> Any:
    from palaestra.engines.local.local import LocalEngine

    async def main() -> Any:
        engine = LocalEngine(model_dir, device="cpu", max_running=8, **engine_kwargs)
        try:
            return await coro_fn(engine)
        finally:
            await engine.close()

    return asyncio.run(main())


def _backend(model_dir: str, **config: Any) -> Any:
    from palaestra.trainers.torch_backend.backend import TorchBackend
    from palaestra.trainers.torch_backend.config import TorchBackendConfig

    return TorchBackend(model_dir, TorchBackendConfig(device="cpu",
                                                      logits_temperature=TEMPERATURE, **config))


def _gaps(engine_full: list[torch.Tensor], trainer_full: torch.Tensor) -> tuple[float, float]:
    from palaestra.run.parity import compare

    max_abs, tvs = compare(torch.cat(engine_full), trainer_full)
    return max_abs, max(tvs)


def test_bitwise_full_vocabulary_parity_is_exactly_zero(model_dir):
    seqs, positions, reported, engine_full = _run(_sample_and_score, model_dir, bitwise=True)
    # the engine's re-run is the forward that sampled: each sampled token's logprob as reported
    for s, pos, lp, full in zip(seqs, positions, reported, engine_full):
        rerun = full.gather(1, torch.tensor([s[t] for t in pos])[:, None]).squeeze(1)
        assert torch.equal(rerun, torch.tensor(lp, dtype=torch.float32))
    for layout in ({}, {"pack_sequences": False}):  # packed rows or one padded row each
        trainer_full = _backend(model_dir, on_policy="bitwise", **layout).full_logprobs(
            seqs, positions)
        assert trainer_full.shape == (sum(map(len, positions)), engine_full[0].shape[1])
        assert torch.equal(torch.cat(engine_full), trainer_full), layout
        assert _gaps(engine_full, trainer_full) == (0.0, 0.0)


def test_default_mode_full_vocabulary_gap_is_reported(model_dir):
    """A float32 engine against a trainer computing in bfloat16: the check sees the gap."""
    seqs, positions, _, engine_full = _run(_sample_and_score, model_dir)
    trainer_full = _backend(model_dir, dtype="bfloat16").full_logprobs(seqs, positions)
    max_abs, tv = _gaps(engine_full, trainer_full)
    print(f"default mode, bf16 trainer vs f32 engine: max |dlogp| {max_abs:.3g}, TV {tv:.3g}")
    assert max_abs > 1e-3 and tv > 1e-4
    # and it is the same distribution: bfloat16 rounding, not another model
    assert tv < 0.2
    float32 = _backend(model_dir, dtype="float32").full_logprobs(seqs, positions)
    assert _gaps(engine_full, float32)[1] < 1e-4


def test_measure_logs_the_run_metrics(model_dir):
    """`run.parity.measure` on a batch of the engine's samples: positions drawn from the
    trained tokens, the metrics a run logs (all exactly 0.0 in bitwise mode)."""
    from palaestra.run import parity
    from palaestra.trainers.batching import TrainBatch

    backend = _backend(model_dir, on_policy="bitwise")

    async def check(engine: Any) -> dict[str, float]:
        from palaestra.engine import SamplingParams

        rng = random.Random(1)
        prompts = [[rng.randrange(5, 700) for _ in range(10)] for _ in range(4)]
        params = SamplingParams(max_new_tokens=8, temperature=TEMPERATURE, ignore_eos=True)
        gens = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        batch = TrainBatch(
            token_ids=[list(p) + list(g.token_ids) for p, g in zip(prompts, gens)],
            loss_mask=[[0] * len(p) + [1] * len(g.token_ids) for p, g in zip(prompts, gens)],
            rollout_logprobs=[[0.0] * len(p) + list(g.logprobs) for p, g in zip(prompts, gens)])
        return await parity.measure(engine, backend, batch, count=10, temperature=TEMPERATURE,
                                    rng=random.Random(0), replay=True)

    metrics = _run(check, model_dir, bitwise=True)
    assert metrics == {parity.MAX_ABS_DIFF: 0.0, parity.TV: 0.0, parity.TV_MEAN: 0.0,
                       parity.POSITIONS: 10.0, parity.REPLAY_MAX_ABS_DIFF: 0.0}


def test_positions_are_trained_tokens_only():
    from palaestra.run.parity import choose_positions

    masks = [torch.tensor([0, 0, 1, 1, 0]), torch.tensor([1, 0, 0]), torch.tensor([0, 1])]
    chosen = choose_positions(masks, 100, random.Random(0))
    assert chosen == {0: [2, 3], 2: [1]}  # never a first token, never an untrained one
    assert sum(map(len, choose_positions(masks, 2, random.Random(0)).values())) == 2


def _random_adapter(backend: Any, seed: int) -> None:
    """Give the freshly initialised adapter (B = 0: a no-op) random B matrices."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in backend.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def test_lora_in_bitwise_mode_has_exactly_zero_gap(model_dir):
    """A LoRA policy pushed to a bitwise engine: merged the same way on both sides, the sampled
    tokens' logprobs and the full distributions are equal bit for bit (and the adapter does
    change the model)."""
    pytest.importorskip("peft")
    from palaestra.trainers.batching import TrainBatch
    from palaestra.trainers.torch_backend.lora import LoraSettings

    backend = _backend(model_dir, on_policy="bitwise", lora=LoraSettings(rank=4, alpha=8.0))
    _random_adapter(backend, 0)
    adapter = backend.adapter_for_engines()
    assert adapter is not None

    async def with_adapter(engine: Any) -> Any:
        await engine.update_adapter(*adapter, name="policy")
        return await _sample_and_score(engine)

    seqs, positions, reported, engine_full = _run(with_adapter, model_dir, bitwise=True)
    trainer_full = backend.full_logprobs(seqs, positions)
    assert _gaps(engine_full, trainer_full) == (0.0, 0.0)
    batch = TrainBatch(token_ids=seqs,
                       loss_mask=[[0] * (len(s) - len(p)) + [1] * len(p)
                                  for s, p in zip(seqs, positions)])
    for lp, s, pos, rep in zip(backend.forward_logprobs(batch), seqs, positions, reported):
        assert torch.equal(lp[pos[0]:], torch.tensor(rep, dtype=torch.float32))
    base = _backend(model_dir, on_policy="bitwise").full_logprobs(seqs, positions)
    assert _gaps(engine_full, base)[1] > 1e-3  # the adapter is not a no-op


def test_bitwise_engine_serves_only_a_merged_default_adapter(model_dir):
    pytest.importorskip("peft")
    from palaestra.errors import EngineError
    from palaestra.trainers.torch_backend.lora import LoraSettings

    backend = _backend(model_dir, lora=LoraSettings(rank=4, alpha=8.0))
    state, config = backend.adapter_for_engines()

    async def named(engine: Any) -> None:
        from palaestra.engines.local.lora import LoraAdapter

        adapter = LoraAdapter.from_peft("other", state, config)
        with pytest.raises(EngineError, match="default one, merged"):
            await engine.load_lora_adapter("other", adapter=adapter)

    _run(named, model_dir, bitwise=True)
    _run(named, model_dir, bitwise=True, lora_mode="lowrank")


def test_bitwise_lora_with_dropout_is_refused(model_dir):
    pytest.importorskip("peft")
    from palaestra.errors import ConfigError
    from palaestra.trainers.torch_backend.lora import LoraSettings

    with pytest.raises(ConfigError, match="dropout"):
        _backend(model_dir, on_policy="bitwise",
                 lora=LoraSettings(rank=4, alpha=8.0, dropout=0.1))

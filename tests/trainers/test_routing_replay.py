"""Routing replay end to end on CPU: the embedded engine records the experts of a tiny random
Qwen3-MoE, the samples carry them, and the torch backend's training forward replays them."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from palaestra.errors import ConfigError
from palaestra.engine import SamplingParams
from palaestra.trainers.algorithms.config import LossConfig
from palaestra.trainers.batching import TrainBatch
from palaestra.trainers.torch_backend.backend import TorchBackend
from palaestra.trainers.torch_backend.config import TorchBackendConfig
from palaestra.types import Sample

pytestmark = pytest.mark.numerics  # bf16 routing flips and replayed logprobs

NUM_EXPERTS = 6


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=NUM_EXPERTS, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[1], max_position_embeddings=256,
        eos_token_id=1, pad_token_id=0, router_aux_loss_coef=0.0,
    )
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # a router whose top-k moves under small perturbations (bf16)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, 0.05)
    path = tmp_path_factory.mktemp("moe")
    model.save_pretrained(path)
    return path


def _rollout(moe_dir: Path, dtype: str, n: int = 6) -> list[Sample]:
    """Samples from the embedded engine, routed experts padded to one row per token."""
    from palaestra.engines.local.local import LocalEngine

    async def go() -> list[Sample]:
        engine = LocalEngine(moe_dir, device="cpu", dtype=dtype, prefix_cache_tokens=0)
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(2, 96, (8 + i,), generator=g).tolist() for i in range(n)]
        try:
            gens = await asyncio.gather(*(engine.generate(
                p, SamplingParams(max_new_tokens=16, temperature=1.0, seed=i, ignore_eos=True))
                for i, p in enumerate(prompts)))
        finally:
            await engine.close()
        samples = []
        for p, gen in zip(prompts, gens):
            ids = p + list(gen.token_ids)
            routes = torch.full((len(ids), 3, 2), -1, dtype=torch.int16)
            got = gen.meta["routed_experts"]
            routes[: got.shape[0]] = got
            samples.append(Sample(
                token_ids_T=tuple(ids), loss_mask_T=(0,) * len(p) + (1,) * len(gen.token_ids),
                logprobs_T=(0.0,) * len(p) + tuple(gen.logprobs),
                versions_T=(-1,) * len(p) + (0,) * len(gen.token_ids), prompt_len=len(p),
                group_id="g", reward=float(len(samples) % 2), routed_experts=routes,
                advantage=1.0 if len(samples) % 2 else -1.0))
        return samples

    return asyncio.run(go())


def _gap(backend: TorchBackend, batch: TrainBatch) -> float:
    """Mean |trainer - engine| logprob over the sampled tokens."""
    logps = backend.forward_logprobs(batch)
    diffs = [((lp - r) * m).abs().sum() / m.sum()
             for lp, r, m in zip(logps, batch.rollout_logprobs, batch.loss_mask)]
    return float(torch.stack(diffs).mean())


def _backend(moe_dir: Path, replay: str, **kw) -> TorchBackend:
    return TorchBackend(moe_dir, TorchBackendConfig(device="cpu", dtype="float32", lr=1e-3,
                                                    routing_replay=replay, **kw))


def test_replay_reproduces_the_engine_logprobs_and_forces_the_experts(moe_dir: Path) -> None:
    samples = _rollout(moe_dir, "float32")
    batch = TrainBatch.from_samples(samples)
    assert batch.routed_experts is not None
    replay = _backend(moe_dir, "rollout")
    assert _gap(replay, batch) < 1e-4
    assert replay.routing_replay.replayed_tokens > 0
    # other expert ids are really used: the logprobs move away from the engine's
    shifted = batch.replace(routed_experts=tuple(
        torch.where(r >= 0, (r + 2) % NUM_EXPERTS, r) for r in batch.routed_experts))
    assert _gap(replay, shifted) > 1e-3  # 20x the replayed gap bound
    # padded rows (no packing) carry the same routes
    padded = _backend(moe_dir, "rollout", pack_sequences=False)
    assert _gap(padded, batch) < 1e-4


def test_router_still_learns_under_replay(moe_dir: Path) -> None:
    samples = _rollout(moe_dir, "float32", n=4)
    batch = TrainBatch.from_samples(samples)
    backend = _backend(moe_dir, "rollout")
    gate = backend.model.model.layers[0].mlp.gate.weight
    before = gate.detach().clone()
    metrics = backend.train_step(batch, LossConfig(preset="grpo"))
    assert not torch.equal(before, gate.detach())  # the gate got gradients through the softmax
    assert "actor/rollout_kl" in metrics
    assert metrics["actor/rollout_kl"] < 1e-6  # fp32, replayed: on-policy to rounding


#: the near-tied MoE's expert weights: 5x the initialiser's 0.02, so that a token routed to
#: another expert moves the next logprob 55-115x more than bf16 rounding does (five seeds of
#: this fixture, 2026-12-04, with torch's AVX-512 and AVX2 kernels alike)
EXPERT_STD = 0.1


@pytest.fixture(scope="module")
def near_tied_moe_dir(moe_dir: Path, tmp_path_factory) -> Path:
    """The MoE of `moe_dir` built so that the replay test's premise holds on any CPU, by
    construction rather than by luck:

    - its router rows are one shared row plus a small spread, so every token's expert logits
      are near-tied and bf16 rounding reorders the top-k of some tokens;
    - its experts are strong and unlike each other (weights of std EXPERT_STD, not the 0.02 of
      the initialiser: each expert's output outweighs the rest of the residual stream), so a
      token routed to another expert gets another hidden state, and the logprobs after it
      move by far more than bf16 rounding moves them, whatever the CPU's bf16 kernels."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(moe_dir)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                w = layer.mlp.gate.weight
                shared = torch.randn(1, w.shape[1], generator=g) * 0.3
                w.copy_(shared + torch.randn(w.shape, generator=g) * 0.05)
                for p in layer.mlp.experts.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * EXPERT_STD)
    path = tmp_path_factory.mktemp("moe-near-tied")
    model.save_pretrained(path)
    return path


def _fp32_topk_routes(model_dir: Path, batch: TrainBatch) -> list[torch.Tensor]:
    """What an fp32 forward (HF's, no replay) routes each position of each row to: sorted top-k
    expert ids per MoE layer, ``[T, layers, k]`` with -1 on dense layers as the engine records."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids, engine in zip(batch.token_ids, batch.routed_experts):
            logits = model(ids[None], output_router_logits=True).router_logits
            routes = torch.full_like(engine, -1)
            moe_layers = [i for i in range(engine.shape[1]) if int(engine[0, i, 0]) >= 0]
            for layer, router in zip(moe_layers, logits, strict=True):
                routes[:, layer] = router.topk(engine.shape[2], dim=-1).indices.to(routes.dtype)
            out.append(routes.sort(-1).values)
    return out


def test_replay_closes_the_bf16_rollout_mismatch(near_tied_moe_dir: Path) -> None:
    """A bf16 engine routes some tokens differently from the fp32 trainer; replay removes that
    part of the rollout-vs-training gap (what remains is bf16 rounding)."""
    batch = TrainBatch.from_samples(_rollout(near_tied_moe_dir, "bfloat16", n=8))
    fp32_routes = _fp32_topk_routes(near_tied_moe_dir, batch)
    # positions whose route (any layer) differs from the one fp32 takes; a token's logprob
    # depends on the routes of every position up to the one before it
    differs = [(e.sort(-1).values != f).any(-1).any(-1)
               for e, f in zip(batch.routed_experts, fp32_routes)]
    assert int(sum(int(d.sum()) for d in differs)) > 0, "the premise: bf16 routes differ"
    no = torch.zeros(1, dtype=torch.bool)
    # the logprob of token t is computed at position t - 1: "flipped" when that position was
    # routed differently (the route's whole effect), "clean" when no position < t was (bf16
    # rounding alone); tokens after a flip only through attention are neither
    flipped = [torch.cat([no, d[:-1]]) for d in differs]
    clean = [~torch.cat([no, d[:-1].cummax(0).values]) for d in differs]
    free, replayed = _backend(near_tied_moe_dir, "off"), _backend(near_tied_moe_dir, "rollout")

    def gaps(backend: TorchBackend) -> tuple[float, float]:
        """Mean |trainer - engine| over the sampled tokens: (flipped, clean)."""
        sums = torch.zeros(2, dtype=torch.float64)
        counts = torch.zeros(2, dtype=torch.float64)
        for lp, r, m, f, c in zip(backend.forward_logprobs(batch), batch.rollout_logprobs,
                                  batch.loss_mask, flipped, clean):
            d = ((lp - r).abs() * m).double()
            for i, sel in enumerate((f, c)):
                sums[i] += d[sel].sum()
                counts[i] += m[sel].sum()
        assert counts.min() > 0, counts  # both kinds of token are sampled
        return float(sums[0] / counts[0]), float(sums[1] / counts[1])

    (free_flipped, free_clean), (replay_flipped, replay_clean) = gaps(free), gaps(replayed)
    # the part routing causes: where the route differed, the free trainer's gap is above the
    # bf16 rounding level of the clean tokens by several times that level (the fixture's strong
    # experts make a flipped route dominate rounding on any CPU: 55x here, 2026-12-04)...
    routing_part = free_flipped - free_clean
    assert routing_part > 4 * free_clean, (free_flipped, free_clean)
    # ...replay removes it (the flipped tokens fall to the rounding level)...
    assert replay_flipped - replay_clean < 0.1 * routing_part, (replay_flipped, replay_clean)
    # ...and only it: where no route differed, replay changes nothing but the rounding
    assert abs(replay_clean - free_clean) < 0.01 * free_clean, (replay_clean, free_clean)
    kl = {name: b.train_step(batch, LossConfig(preset="grpo"))["actor/rollout_kl"]
          for name, b in (("off", free), ("rollout", replayed))}
    assert kl["rollout"] < kl["off"], kl


def test_replay_refuses_a_dense_model(tmp_path: Path) -> None:
    from palaestra.tiny_model import build_model

    path = build_model(tmp_path / "m", "micro")
    with pytest.raises(ConfigError, match="MoE"):
        _backend(path, "rollout")


def test_batch_checks_route_shapes() -> None:
    from palaestra.errors import TrajectoryValidationError

    with pytest.raises(TrajectoryValidationError, match="routed_experts"):
        TrainBatch(token_ids=[torch.arange(4)], loss_mask=[torch.tensor([0, 1, 1, 1.0])],
                   routed_experts=[torch.zeros(3, 2, 2)])


def test_replay_of_deepseek_v3_sigmoid_routing(tmp_path: Path) -> None:
    """DeepSeek-V3's router (sigmoid, expert bias, groups, scaling): the engine's routes replayed
    give the engine's logprobs; shifted routes change them."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
        routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
        max_position_embeddings=256, eos_token_id=1, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.1)
    model.save_pretrained(tmp_path)
    batch = TrainBatch.from_samples(_rollout(tmp_path, "float32", n=4))
    replay = _backend(tmp_path, "rollout")
    assert len(replay.routing_replay.routers) == 2
    assert _gap(replay, batch) < 1e-4
    shifted = batch.replace(routed_experts=tuple(
        torch.where(r >= 0, (r + 3) % 8, r) for r in batch.routed_experts))
    assert _gap(replay, shifted) > 1e-3

"""The trainer group: two torch-backend ranks (FSDP2 over gloo) as Ray actors on CPU bundles of a
real placement group train exactly like one process: same losses, grad norms and logprobs over a
few steps, the same final weights (fp32, within 1e-5), and a checkpoint that one process loads.
The ranks get their token-balanced shards as object references, never the whole batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from palaestra.run.fleet.placement import PlacementSection, plan_run
from palaestra.trainers.algorithms.config import LossConfig
from palaestra.trainers.batching import TrainBatch
from palaestra.trainers.micro_batches import split_across_ranks

torch.set_num_threads(1)
ray = pytest.importorskip("ray")


def tiny_model(path: Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    return path


def batch(seed: int, n: int = 10) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids, masks, adv = [], [], []
    for i in range(n):
        length = 50 if i == 0 else 6 + (i * 7 + seed) % 15
        ids.append(torch.randint(0, 300, (length,), generator=g))
        mask = torch.tensor([0.0] * 3 + [1.0] * (length - 3))
        masks.append(mask)
        adv.append(mask * float(torch.randn(1, generator=g)))
    return TrainBatch(token_ids=ids, loss_mask=masks, advantages=adv,
                      group_ids=[f"p{i // 5}" for i in range(n)])


@pytest.fixture(scope="module")
def ray_local():
    if ray.is_initialized():  # another folder's session cluster (tests/rollout's): size our own
        ray.shutdown()
    ray.init(num_cpus=4, include_dashboard=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


@pytest.mark.slow
def test_two_rank_group_matches_one_process(tmp_path, ray_local):
    from palaestra.trainers.group.group import TrainerGroup
    from palaestra.trainers.torch_backend.backend import TorchBackend
    from palaestra.trainers.torch_backend.config import TorchBackendConfig

    model = tiny_model(tmp_path / "model")
    cfg = TorchBackendConfig(device="cpu", dtype="float32", lr=1e-3,
                             max_tokens_per_micro_batch=48, pack_sequences=False)
    loss = LossConfig.from_preset("grpo", entropy_coef=0.01)
    plan = plan_run(PlacementSection(gpus_per_node=0, trainer_ranks=2, cpus_per_rank=1.0),
                    on_gpu=False)
    one = TorchBackend(model, cfg)
    with TrainerGroup(model, cfg, plan) as group:
        assert [r["rank"] for r in group.ranks] == [0, 1]
        assert len({r["pid"] for r in group.ranks}) == 2  # two processes, not the driver
        b0 = batch(0)
        parts, refs = group.shards(b0, loss)
        assert parts == split_across_ranks(b0.lengths, 2) and all(parts)
        sub, sub_weights = ray.get(refs[1])  # rank 1's object holds only its sequences
        assert sub.num_sequences == len(parts[1]) == len(sub_weights) < b0.num_sequences
        for got, want in zip(group.forward_logprobs(b0), one.forward_logprobs(b0)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        for step in range(3):
            b = batch(step)
            g, o = group.train_step(b, loss), one.train_step(b, loss)
            assert g["loss"] == pytest.approx(o["loss"], abs=1e-5), step
            assert g["grad_norm"] == pytest.approx(o["grad_norm"], rel=1e-4)
            assert g["actor/entropy"] == pytest.approx(o["actor/entropy"], rel=1e-5)
            assert g["num_tokens"] == o["num_tokens"] == b.num_tokens
        assert group.step == 3
        weights_g = group.state_dict_for_engines()
        weights_o = one.state_dict_for_engines()
        assert sorted(weights_g) == sorted(weights_o)
        moved = max(float((weights_o[k] - TorchBackend(model, cfg).state_dict_for_engines()[k])
                          .abs().max()) for k in list(weights_o)[:3])
        assert moved > 1e-4  # training changed the weights (the comparison below means something)
        for k in weights_o:
            torch.testing.assert_close(weights_g[k], weights_o[k], atol=1e-5, rtol=0)
        group.save(tmp_path / "ckpt", extra={"rl_step": 3})
        group.export_hf(tmp_path / "hf")
        offloaded, onloaded = group.offload(), group.onload()
        # CPU ranks: no GPU memory either side, and no device bytes to move
        assert [{k: v for k, v in r.items() if k != "offloaded_gib"} for r in offloaded] \
            == onloaded
        assert all(r["offloaded_gib"] == 0.0 for r in offloaded)
    resumed = TorchBackend(model, cfg)
    assert resumed.load(tmp_path / "ckpt")["rl_step"] == 3 and resumed.step == 3
    b = batch(7)
    assert resumed.train_step(b, loss)["loss"] == pytest.approx(one.train_step(b, loss)["loss"],
                                                                abs=1e-5)

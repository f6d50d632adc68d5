"""GPU (one CUDA device): a colocated trainer rank and embedded engine time-slice one GPU.

The engine frees its KV cache and weights (`LocalEngine.release_memory`) while the trainer
steps; the trainer offloads parameters, gradients and optimizer state to host memory
(`TorchBackend.offload`) while the engine serves. Memory per phase is printed (run with ``-s``)
and checked: each side's release frees what it held, and training after an offload/onload cycle
gives exactly the losses of a backend that never left the GPU. Also a trainer group of one rank
as a Ray actor on a GPU bundle (``num_gpus`` 0.5, as colocated) offloads and onloads."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GIB = 1024**3


def _batch(n: int = 8):
    from palaestra.trainers.batching import TrainBatch

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 200, (64 + 8 * i,), generator=g) for i in range(n)]
    masks = [torch.tensor([0.0] * 8 + [1.0] * (len(t) - 8)) for t in ids]
    adv = [m * (1.0 if i % 2 else -1.0) for i, m in enumerate(masks)]
    return TrainBatch(token_ids=ids, loss_mask=masks, advantages=adv,
                      group_ids=[f"g{i // 4}" for i in range(n)])


def test_colocated_phases_free_memory_and_keep_training_exact(tmp_path):
    from palaestra.engines.local.local import LocalEngine
    from palaestra.engine import SamplingParams
    from palaestra.tiny_model import build_model
    from palaestra.trainers.algorithms.config import LossConfig
    from palaestra.trainers.torch_backend.backend import TorchBackend
    from palaestra.trainers.torch_backend.config import TorchBackendConfig

    model = build_model(tmp_path / "m", "small")
    cfg = TorchBackendConfig(device="cuda", dtype="float32", lr=1e-4)
    loss = LossConfig.from_preset("grpo")
    batch = _batch()

    def used() -> float:
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() / GIB

    async def main() -> dict[str, float]:
        engine = LocalEngine(model, device="cuda", max_running=64, max_model_len=512, seed=0)
        sampling = SamplingParams(max_new_tokens=32, temperature=1.0)
        await engine.generate([1, 2, 3], sampling)
        mem = {"engine_serving": used()}
        trainer = TorchBackend(model, cfg)
        reference = TorchBackend(model, cfg)  # never offloaded
        mem["both_resident"] = used()
        times = {}
        for step in range(3):
            await engine.release_memory()  # training phase: the engine holds nothing
            mem[f"train_{step}_engine_released"] = used()
            trainer.onload()
            t0 = time.perf_counter()
            got = trainer.train_step(batch, loss)
            times[f"train_{step}_s"] = time.perf_counter() - t0
            want = reference.train_step(batch, loss)
            assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
            held = _state_bytes(trainer) / GIB
            before = used()
            trainer.offload()
            mem[f"rollout_{step}_freed_by_offload"] = before - used()
            mem[f"rollout_{step}_trainer_state"] = held  # rollout phase: the trainer holds nothing on the GPU
            mem[f"rollout_{step}_trainer_offloaded"] = used()
            await engine.resume_memory()
            await engine.update_weights(trainer.state_dict_for_engines(device="cuda"),
                                        version=step + 1)
            t0 = time.perf_counter()
            await asyncio.gather(*(engine.generate([1, 2, 3 + i], sampling) for i in range(32)))
            times[f"rollout_{step}_s"] = time.perf_counter() - t0
        await engine.close()
        return {**mem, **times}

    out = asyncio.run(main())
    for key, value in out.items():
        print(f"{key:36s} {value:8.3f}")
    assert out["train_0_engine_released"] < out["both_resident"]  # KV cache and weights freed
    for step in range(3):  # the offload frees the trainer's weights, grads and Adam state
        assert out[f"rollout_{step}_freed_by_offload"] >= 0.9 * out[f"rollout_{step}_trainer_state"]


def _state_bytes(backend) -> int:
    params = [p for p in backend.model.parameters()]
    total = sum(p.numel() * p.element_size() for p in params)
    total += sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    for state in backend.optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0 and v.is_cuda)
    return total


def test_group_of_one_gpu_rank_offloads(tmp_path):
    ray = pytest.importorskip("ray")
    from palaestra.run.fleet.placement import PlacementSection, plan_run
    from palaestra.tiny_model import build_model
    from palaestra.trainers.group.group import TrainerGroup
    from palaestra.trainers.torch_backend.config import TorchBackendConfig

    model = build_model(tmp_path / "m", "small")
    plan = plan_run(PlacementSection(gpus_per_node=1, trainer_ranks=1, colocate=True),
                    on_gpu=True)
    assert plan.trainer_gpu_fraction == 0.5
    ray.init(num_gpus=1, num_cpus=4, include_dashboard=False)
    try:
        with TrainerGroup(model, TorchBackendConfig(device="cuda"), plan) as group:
            resident = group.memory()[0]["allocated_gib"]
            offloaded = group.offload()[0]["allocated_gib"]
            back = group.onload()[0]["allocated_gib"]
            print(f"rank memory GiB: resident {resident:.3f} offloaded {offloaded:.3f} "
                  f"onloaded {back:.3f}")
            assert offloaded < resident and back == pytest.approx(resident, rel=0.05)
    finally:
        ray.shutdown()

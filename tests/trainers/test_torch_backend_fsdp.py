"""FSDP2 path of TorchBackend: two ranks under torchrun match one process exactly.

The same test runs on CPU (gloo; ``slow``) and on two CUDA GPUs (NCCL; ``gpu``). Both ranks get
the same full batch; the backend splits it by tokens, and the rank with fewer micro-batches
runs empty ones so the FSDP collectives stay in step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from palaestra.trainers.algorithms.config import LossConfig
from palaestra.trainers.batching import TrainBatch

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


def make_batch(seed: int = 2, n: int = 9) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids, masks, adv = [], [], []
    for i in range(n):
        length = 60 if i == 0 else 6 + (i * 5) % 14  # one long sequence: unequal micro-batches
        ids.append(torch.randint(0, 300, (length,), generator=g))
        mask = torch.tensor([0.0] * 3 + [1.0] * (length - 3))
        masks.append(mask)
        adv.append(mask * (1.0 if i % 2 else -1.0))
    return TrainBatch(token_ids=ids, loss_mask=masks, advantages=adv,
                      group_ids=[f"p{i // 3}" for i in range(n)])


WORKER = r'''
import json, sys, torch
from pathlib import Path
from palaestra.trainers.algorithms.config import LossConfig
from palaestra.trainers.batching import TrainBatch
from palaestra.trainers.torch_backend import TorchBackend, TorchBackendConfig

torch.set_num_threads(1)
model_dir, out_dir, device = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
data = json.loads((out_dir / "batch.json").read_text())
batch = TrainBatch(token_ids=data["ids"], loss_mask=data["mask"], advantages=data["adv"],
                   group_ids=data["groups"])
cfg = TorchBackendConfig(device=device, dtype="float32", lr=1e-3, max_tokens_per_micro_batch=32)
b = TorchBackend(model_dir, cfg)
assert b.fsdp and b.dist.world_size == 2
logps = b.forward_logprobs(batch)
loss_cfg = LossConfig.from_preset("grpo", entropy_coef=0.01)
metrics = [b.train_step(batch, loss_cfg) for _ in range(2)]
sd = b.state_dict_for_engines()
b.save(out_dir / "ckpt")
b.export_hf(out_dir / "hf")
if b.dist.rank == 0:
    assert set(sd) and all(t.device.type == "cpu" for t in sd.values())
    (out_dir / "result.json").write_text(json.dumps(
        {"logps": [t.tolist() for t in logps], "metrics": metrics, "keys": sorted(sd)}))
else:
    assert sd == {}
torch.distributed.destroy_process_group()
'''

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.slow, id="cpu-gloo"),
    pytest.param("cuda", id="cuda-nccl", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
    ]),
]


@pytest.mark.parametrize("device", DEVICES)
def test_fsdp2_two_ranks_match_one_process(tmp_path, device):
    from transformers import AutoModelForCausalLM

    from palaestra.trainers.torch_backend.backend import TorchBackend
    from palaestra.trainers.torch_backend.config import TorchBackendConfig

    model_dir = tiny_qwen3(tmp_path / "model")
    batch = make_batch()
    (tmp_path / "batch.json").write_text(json.dumps({
        "ids": [t.tolist() for t in batch.token_ids],
        "mask": [t.tolist() for t in batch.loss_mask],
        "adv": [t.tolist() for t in batch.advantages],
        "groups": list(batch.group_ids),
    }))
    (tmp_path / "worker.py").write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", "29533" if device == "cuda" else "29534",
         str(tmp_path / "worker.py"), str(model_dir), str(tmp_path), device],
        env=env, capture_output=True, text=True, timeout=500, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads((tmp_path / "result.json").read_text())

    def single() -> TorchBackend:
        return TorchBackend(model_dir, TorchBackendConfig(
            device=device, dtype="float32", lr=1e-3, max_tokens_per_micro_batch=32))

    one = single()
    for got, want in zip(result["logps"], one.forward_logprobs(batch)):
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=0)
    loss_cfg = LossConfig.from_preset("grpo", entropy_coef=0.01)
    for fsdp_metrics in result["metrics"]:
        m = one.train_step(batch, loss_cfg)
        assert fsdp_metrics["loss"] == pytest.approx(m["loss"], abs=1e-5)
        assert fsdp_metrics["grad_norm"] == pytest.approx(m["grad_norm"], rel=1e-4)
        assert fsdp_metrics["actor/entropy"] == pytest.approx(m["actor/entropy"], rel=1e-5)
    assert result["keys"] == sorted(one.state_dict_for_engines())

    # the FSDP checkpoint (full state dicts) loads into one process and continues identically
    resumed = single()
    resumed.load(tmp_path / "ckpt")
    assert resumed.step == 2
    ids = batch.token_ids[1][None].to(resumed.device)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).to(resumed.device)
    with torch.no_grad():
        torch.testing.assert_close(exported.eval()(input_ids=ids).logits,
                                   resumed.model(input_ids=ids).logits, atol=1e-5, rtol=0)
    a, b = resumed.train_step(batch, loss_cfg), one.train_step(batch, loss_cfg)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)

"""Two GPUs: DP=2, TP=2, PP=2 and (Qwen3-MoE, DeepSeek-V3) EP=2 give one GPU's SFT losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

WORKER = Path(__file__).with_name("multi_gpu_worker.py")


def _run(tmp_path: Path, nproc: int, layout: dict) -> dict:
    out = tmp_path / f"{nproc}_{'_'.join(f'{k}{v}' for k, v in layout.items())}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                    str(WORKER), json.dumps(layout), str(out)], check=True, env=env, timeout=300)
    return json.loads(out.read_text())


def test_parallel_layouts_match_one_gpu(tmp_path):
    pytest.importorskip("megatron.core")
    single = _run(tmp_path, 1, {})
    for layout in ({}, {"tp": 2}, {"pp": 2}):  # {} on two ranks is DP=2
        multi = _run(tmp_path, 2, layout)
        assert multi["losses"] == pytest.approx(single["losses"], rel=1e-4), layout
        assert multi["weight_sum"] == pytest.approx(single["weight_sum"], rel=1e-4), layout


def test_expert_parallel_moe_matches_one_gpu(tmp_path):
    pytest.importorskip("megatron.core")
    single = _run(tmp_path, 1, {"moe": True})
    multi = _run(tmp_path, 2, {"moe": True, "ep": 2})
    assert multi["losses"] == pytest.approx(single["losses"], rel=1e-4)
    assert multi["weight_sum"] == pytest.approx(single["weight_sum"], rel=1e-4)


def test_deepseek_v3_expert_and_data_parallel_match_one_gpu(tmp_path):
    pytest.importorskip("megatron.core")
    single = _run(tmp_path, 1, {"deepseek": True})
    for layout in ({"deepseek": True}, {"deepseek": True, "ep": 2}):  # DP=2, then EP=2
        multi = _run(tmp_path, 2, layout)
        assert multi["losses"] == pytest.approx(single["losses"], rel=1e-4), layout
        assert multi["weight_sum"] == pytest.approx(single["weight_sum"], rel=1e-4), layout

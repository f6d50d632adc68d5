"""``[placement]``: the plan (bundles per node, ranks, engines, memory per GPU) that ``--dry-run``
prints, and the impossible layouts refused when the config loads (exit 2, every reason)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from palaestra.config import load_config
from palaestra.errors import ConfigError
from palaestra.run.fleet.placement import PlacementSection, plan_problems, plan_run
from palaestra.run.config import TrainConfig
from palaestra.run.dry_run import describe_plan

REPO = Path(__file__).resolve().parents[2]
DP2 = REPO / "configs/quickstart_dp2.toml"


def test_gpu_plan_over_two_nodes():
    plan = plan_run(PlacementSection(nodes=2, gpus_per_node=8, trainer_ranks=6, critic_ranks=1,
                                     reference_ranks=1, engine_gpus=8, engine_tp=4),
                    on_gpu=True)
    assert plan.num_gpus == 16 and plan.trainer_bundles == tuple(range(6))
    assert plan.critic_bundles == (6,) and plan.reference_bundles == (7,)
    assert plan.engine_bundles == ((8, 9, 10, 11), (12, 13, 14, 15))
    assert [plan.node_of_bundle[b] for b in (0, 7, 8, 15)] == [0, 0, 1, 1]
    text = "\n".join(plan.describe_lines())
    assert "node 0: bundles [0, 1, 2, 3, 4, 5, 6, 7]" in text
    assert "bundle 12 [GPU 1, CPU 1]: engine 1" in text


def test_colocated_and_cpu_plans():
    plan = plan_run(PlacementSection(gpus_per_node=4, trainer_ranks=4, colocate=True), on_gpu=True)
    assert plan.num_gpus == 4 and plan.trainer_gpu_fraction == 0.5
    assert plan.engine_bundles == ((0,), (1,), (2,), (3,))
    cpu = plan_run(PlacementSection(gpus_per_node=0, trainer_ranks=3, cpus_per_rank=0.5),
                   on_gpu=False)
    assert cpu.bundles == ({"CPU": 0.5},) * 3 and cpu.num_gpus == 0 and cpu.layout == {"fsdp": 3}


def test_every_problem_is_listed():
    problems = plan_problems(PlacementSection(nodes=1, gpus_per_node=4, trainer_ranks=3,
                                              engine_gpus=5, engine_tp=2, colocate=True),
                             on_gpu=True, model_parallel=2)
    text = " | ".join(problems)
    assert "multiple of the trainer's model parallelism" in text
    assert "multiple of placement.engine_tp" in text and "must equal trainer_ranks" in text
    assert plan_problems(PlacementSection(gpus_per_node=8, trainer_ranks=2, engine_gpus=12,
                                          engine_tp=2), on_gpu=True)[0].startswith(
        "the plan needs 14 GPUs")
    span = plan_problems(PlacementSection(nodes=2, gpus_per_node=4, trainer_ranks=3,
                                          engine_gpus=4, engine_tp=2), on_gpu=True)
    assert span and "across a node boundary" in span[0]
    with pytest.raises(ConfigError, match="impossible placement"):
        plan_run(PlacementSection(gpus_per_node=0, engine_gpus=1), on_gpu=False)


def test_dry_run_prints_the_section_plan():
    cfg = load_config(TrainConfig, DP2)
    text = describe_plan(cfg, environ={"PALAESTRA_GPUS": "8"})  # the section wins over env
    assert "2 trainer rank(s) (fsdp 2) on CPU bundles" in text
    assert "bundle 1 [CPU 1]: trainer rank 1" in text and "trainer group: 2 ranks" in text
    gpu = load_config(TrainConfig, DP2, [
        "--trainer.torch.device", "cuda", "--placement.gpus_per_node", "4",
        "--placement.model_shape", "qwen3-0.6b", "--placement.engine_gpus", "2",
        "--engine.kind", "sglang", "--engine.urls", '["http://127.0.0.1:30000"]'])
    text = describe_plan(gpu, environ={})
    table = [line for line in text.splitlines() if line[:3].strip().isdigit()]
    assert [line.split()[1:3] for line in table] == [["trainer", "rank"]] * 2 + [["engine", "0"],
                                                                                 ["engine", "1"]]


def test_impossible_layout_exits_2_with_the_reason():
    proc = subprocess.run(
        [sys.executable, "-m", "palaestra.cli", "train", str(DP2), "--dry-run",
         "--placement.trainer_ranks", "4", "--trainer.backend", "megatron",
         "--placement.colocate", "true", "--rollout.mode", "async"],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Megatron-core trains on CUDA GPUs" in proc.stderr  # gpus_per_node = 0: CPU nodes
    assert "with rollout.mode = 'async'" in proc.stderr  # colocated phases are time-sliced
    assert "Traceback" not in proc.stderr

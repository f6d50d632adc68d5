"""Megatron ranks in a trainer group, on CPU: what can be checked without CUDA.

megatron-core trains on CUDA GPUs only, so here: the load-time checks of ``[placement]`` (a
Megatron group on CPU nodes, or with pipeline stages, is refused with the fix; tp x dp on GPU
nodes is planned), a `TrainerRank` given a `MegatronBackendConfig` refuses clearly before it
touches a process group, and the group's data-parallel bookkeeping for a tp 2 x dp 2 layout
(which ranks share a shard, whose counts and rows are taken). The training itself runs in
tests/trainers/test_group_megatron_gpu.py on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from palaestra.config import load_config
from palaestra.errors import ConfigError, MissingExtraError
from palaestra.run.config import TrainConfig

REPO = Path(__file__).resolve().parents[2]


def _megatron(*overrides: str, **megatron: int) -> TrainConfig:
    """The quickstart_dp2 config with ``overrides`` and trainer.backend = 'megatron' (set after
    loading: loading it checks that megatron-core is installed, which it is not here)."""
    cfg = load_config(TrainConfig, REPO / "configs/quickstart_dp2.toml", list(overrides))
    trainer = cfg.trainer.model_copy(update={
        "backend": "megatron", "megatron": cfg.trainer.megatron.model_copy(update=megatron)})
    return cfg.model_copy(update={"trainer": trainer})


def test_megatron_group_layouts_at_load_time():
    from palaestra.run.trainer_plan import placement_problems, run_plan

    gpu = ["--placement.gpus_per_node", "8", "--placement.trainer_ranks", "4"]
    cfg = _megatron(*gpu, tp=2)
    assert placement_problems(cfg) == []
    plan = run_plan(cfg)
    assert plan is not None and plan.layout == {"tp": 2, "pp": 1, "dp": 2, "ep": 1}
    assert len(plan.trainer_bundles) == 4 and plan.on_gpu
    (cpu,) = placement_problems(_megatron())  # quickstart_dp2: gpus_per_node = 0
    assert "Megatron-core trains on CUDA GPUs" in cpu.message
    assert "placement.gpus_per_node >= 1" in cpu.message
    (pp,) = placement_problems(_megatron(*gpu, pp=2))
    assert "holds only the first pipeline stage" in pp.message


def test_megatron_rank_refuses_clearly_without_cuda(tmp_path):
    from palaestra.tiny_model import build_model
    from palaestra.trainers.group.actor import TrainerRank
    from palaestra.trainers.megatron.config import MegatronBackendConfig

    model = build_model(tmp_path / "m", "micro")
    with pytest.raises(ConfigError, match="first pipeline stage"):
        TrainerRank(0, 2).init(str(model), MegatronBackendConfig(pp=2), "127.0.0.1", 1)
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("megatron-core is installed here: the GPU test trains a rank")
    with pytest.raises(MissingExtraError, match="megatron"):
        TrainerRank(0, 1).init(str(model), MegatronBackendConfig(), "127.0.0.1", 1)


def test_tp_ranks_of_one_data_parallel_rank_share_its_shard():
    from palaestra.run.fleet.placement import PlacementSection, plan_run
    from palaestra.trainers.group.group import TrainerGroup

    plan = plan_run(PlacementSection(gpus_per_node=4, trainer_ranks=4), on_gpu=True,
                    backend="megatron", model_parallel=2, tp=2)
    group = TrainerGroup("unused", None, plan)
    assert group.dp_size == 4  # before start: every rank its own data-parallel rank
    # what four Megatron ranks (tp 2, dp 2; megatron orders tp fastest) answer from `init`
    group.ranks = [{"rank": r, "dp_rank": r // 2, "dp_size": 2, "dp_leader": int(r % 2 == 0),
                    "node": "n"} for r in range(4)]
    assert group.dp_size == 2
    assert [group._dp_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert group._leaders() == [0, 2]  # counts and logprob rows from TP rank 0 of each

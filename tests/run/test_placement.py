"""GPU placement plans (pure, no GPUs needed) and the clear failure without GPUs."""

from __future__ import annotations

import pytest

from palaestra.errors import ConfigError
from palaestra.run.fleet.placement import PlacementConfig, plan_placement


def test_disaggregated_plan():
    plan = plan_placement(PlacementConfig(trainer_gpus=4, engine_gpus=4, engine_tp=2))
    assert plan.num_gpus == 8 and len(plan.bundles) == 8
    assert plan.trainer_bundles == (0, 1, 2, 3)
    assert plan.engine_bundles == ((4, 5), (6, 7))
    assert plan.trainer_gpu_fraction == plan.engine_gpu_fraction == 1.0
    assert "disaggregated" in plan.describe()


def test_colocated_plan_shares_gpus():
    plan = plan_placement({"trainer_gpus": 8, "engine_gpus": 8, "engine_tp": 4, "colocate": True})
    assert plan.num_gpus == 8
    assert plan.engine_bundles == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert set(plan.trainer_bundles) == {b for e in plan.engine_bundles for b in e}
    assert plan.trainer_gpu_fraction + plan.engine_gpu_fraction <= 1.0


def test_bad_plans_list_every_problem():
    with pytest.raises(ConfigError) as err:
        plan_placement(PlacementConfig(trainer_gpus=4, engine_gpus=3, engine_tp=2, colocate=True,
                                       num_gpus=2))
    text = str(err.value)
    assert "multiple of engine_tp" in text and "must equal" in text and "only 2" in text
    with pytest.raises(ConfigError, match="node boundary"):
        plan_placement(PlacementConfig(trainer_gpus=3, engine_gpus=4, engine_tp=2,
                                       gpus_per_node=4))


def test_placement_group_needs_gpus(ray_cluster):
    from palaestra.run.fleet.placement import create_placement_group

    plan = plan_placement(PlacementConfig(trainer_gpus=1, engine_gpus=1))
    with pytest.raises(ConfigError, match="needs 2 GPUs"):
        create_placement_group(plan)

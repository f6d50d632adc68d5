"""A run that an existing Ray cluster cannot place is refused with the numbers, before any work.

The asks of a config (`run_asks`), the arithmetic against a cluster (`shortfalls`, `remedies`)
without Ray, then the scenario of a new user: a real two-node ``ray.cluster_utils.Cluster`` of
2 CPUs per node, and ``palaestra train configs/quickstart_dp2.toml`` with four Ray rollout
workers beside its two trainer ranks (6 CPUs asked of 4). Ray would leave two workers
``PENDING_CREATION`` forever; the run must say so within a minute, before its warm start.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from palaestra.config import load_config
from palaestra.ray_capacity import Ask, ClusterView, shortfalls
from palaestra.run.cluster_fit import remedies, run_asks
from palaestra.run.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
DP2 = ROOT / "configs" / "quickstart_dp2.toml"
ISSUE = ["--rollout.cluster", "ray", "--rollout.num_workers", "4", "--warmup.steps", "200",
         "--trainer.steps", "10"]
TWO_BY_TWO = ClusterView(({"CPU": 2.0}, {"CPU": 2.0}), {"CPU": 4.0})


def test_the_asks_of_two_trainer_ranks_and_four_ray_workers() -> None:
    asks = run_asks(load_config(TrainConfig, DP2, ISSUE))
    assert asks == [Ask("trainer ranks", 2, 1.0, 0.0, bundled=True),
                    Ask("rollout workers", 4, 1.0)]
    # in-process workers and a trainer in the driver ask Ray for nothing
    assert run_asks(load_config(TrainConfig, DP2, ["--placement.trainer_ranks", "1"])) == []


def test_the_asks_of_engine_actors_and_a_reward_actor() -> None:
    from palaestra.config import read_toml, validate

    ray = ["--rollout.cluster", "ray"]
    engines = run_asks(load_config(TrainConfig, DP2, [*ray, "--placement.engines", "2",
                                                      "--placement.cpus_per_engine", "1.5"]))
    assert Ask("engine bundles", 2, 1.5, 0.0, bundled=True) in engines
    # colocated engines sit in the trainer ranks' bundles: counted once, in those bundles
    shared = run_asks(load_config(TrainConfig, DP2, [*ray, "--placement.engines", "2",
                                                     "--placement.colocate", "true"]))
    assert shared == [Ask("trainer ranks", 2, 2.0, 0.0, bundled=True),
                      Ask("rollout workers", 1, 1.0)]
    data = read_toml(DP2)
    data["rollout"]["cluster"] = "ray"
    data["rewards"] = [{"kind": "env", "weight": 0.5}]  # scored by a reward actor
    data["reward_worker"] = {"num_cpus": 0.5}
    assert run_asks(validate(TrainConfig, data))[-1] == Ask("reward workers", 1, 0.5, 0.0)


def test_six_cpus_asked_of_four_names_every_number_and_the_fix() -> None:
    asks = [Ask("trainer ranks", 2, 1.0, bundled=True), Ask("rollout workers", 4, 1.0)]
    assert shortfalls(asks, TWO_BY_TWO) == [(
        "needs 6 CPUs: 2 trainer ranks x 1 (placement group bundles) + 4 rollout workers x 1; "
        "the cluster has 4 CPUs (2 nodes: 2 + 2), 4 free")]
    assert remedies(asks, TWO_BY_TWO).startswith("lower --rollout.num_workers to 2, or ")
    # what fits is not refused; CPUs taken by others are (free, not total, is what counts)
    assert shortfalls([asks[0], Ask("rollout workers", 2, 1.0)], TWO_BY_TWO) == []
    busy = ClusterView(TWO_BY_TWO.nodes, {"CPU": 3.0})
    assert "4 CPUs (2 nodes: 2 + 2), 3 free" in shortfalls(
        [asks[0], Ask("rollout workers", 2, 1.0)], busy)[0]


def test_a_request_larger_than_every_node_is_refused_even_when_the_total_fits() -> None:
    problems = shortfalls([Ask("trainer ranks", 1, 3.0, bundled=True)], TWO_BY_TWO)
    assert problems == [("one of the trainer ranks asks 3 CPUs but the largest node has 2 (a "
                         "request is placed on one node)")]
    gpus = shortfalls([Ask("engine bundles", 2, 1.0, 1.0, bundled=True)], TWO_BY_TWO)
    assert gpus[0].startswith("needs 2 GPUs: 2 engine bundles x 1")


@pytest.mark.slow  # a two-node cluster takes ~25-45 s to start on the 2-core machine
@pytest.mark.timeout(400)
def test_a_two_node_cluster_too_small_refuses_the_run_within_a_minute(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        out = tmp_path / "run"
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path])}
        env.pop("RAY_ADDRESS", None)
        start = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "palaestra", "train", str(DP2), "--rollout.ray_address",
             cluster.address, *ISSUE, "--out", str(out)],
            env=env, capture_output=True, text=True, timeout=120, check=False)
        elapsed = time.monotonic() - start
    finally:
        cluster.shutdown()
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    assert elapsed < 60, elapsed
    print(f"refused in {elapsed:.1f} s: {done.stderr.strip().splitlines()[-1]}")
    message = done.stderr
    for part in ("cannot place this run's actors", "needs 6 CPUs", "2 trainer ranks x 1",
                 "4 rollout workers x 1", "the cluster has 4 CPUs (2 nodes: 2 + 2)",
                 "Lower --rollout.num_workers to 2"):
        assert part in message, message
    # refused before any work: no run directory, no model, no warm start
    assert not out.exists(), sorted(p.name for p in out.iterdir())

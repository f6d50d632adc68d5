"""Before a run works: does what it asks of an existing Ray cluster fit in it?

`run_asks` lists the Ray resources an RL run will ask for: its trainer group's placement-group
bundles (``[placement] trainer_ranks > 1``), its engine actors' bundles (``placement.engines`` /
``engine_gpus``), its rollout workers (``rollout.cluster = "ray"``: ``num_workers`` x
``worker_num_cpus``) and its reward actor (``[[rewards]]`` scored by an actor).
`check_cluster_fit` sets them against the free CPUs and GPUs of the cluster the run attaches to
(``rollout.ray_address`` or ``RAY_ADDRESS``) and refuses with the numbers and what to lower,
before the warm start, the evaluations or any rank starts. A Ray actor that cannot be placed
waits forever (``PENDING_CREATION``) rather than failing; this check, and the start timeouts of
the worker pool and the placement groups (``rollout.start_timeout_s``), make it an error.

A run that starts its own local Ray cluster sizes it for its actors and is not checked here
(the start timeouts still apply). Torch-free; Ray is imported only to read the cluster.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from palaestra.errors import ConfigError
from palaestra.ray_capacity import Ask, ClusterView, shortfalls

if TYPE_CHECKING:
    from palaestra.run.config import TrainConfig


def run_asks(cfg: TrainConfig) -> list[Ask]:
    """The Ray requests of an RL run (empty: the run asks Ray for nothing)."""
    from palaestra.rollout.rewards import reward_client
    from palaestra.run.fleet.start import engine_actor_count, shares_trainer_bundles
    from palaestra.run.trainer_plan import group_size, run_plan

    if cfg.algorithm != "rl":
        return []
    asks = []
    plan = run_plan(cfg)
    if plan is not None and group_size(cfg) > 1:
        first = plan.bundles[plan.trainer_bundles[0]]
        asks.append(Ask("trainer ranks", len(plan.trainer_bundles), first.get("CPU", 0.0),
                        first.get("GPU", 0.0), bundled=True))
    if plan is not None and engine_actor_count(cfg) and not shares_trainer_bundles(cfg, plan):
        spans = plan.engine_bundles
        first = plan.bundles[spans[0][0]]
        asks.append(Ask("engine bundles", sum(len(s) for s in spans), first.get("CPU", 0.0),
                        first.get("GPU", 0.0), bundled=True))
    r = cfg.rollout
    if r.cluster == "ray":
        asks.append(Ask("rollout workers", r.num_workers, r.worker_num_cpus))
    rewards = reward_client(cfg.rewards, cfg.reward_worker, r.cluster)
    if rewards is not None and rewards.placement == "actor":
        s = cfg.reward_worker
        asks.append(Ask("reward workers", 1, s.num_cpus, s.num_gpus))
    return asks


def remedies(asks: list[Ask], cluster: ClusterView) -> str:
    """What to lower so that ``asks`` fit ``cluster`` (the rollout workers first)."""
    out = []
    workers = next((a for a in asks if a.what == "rollout workers"), None)
    if workers is not None:
        others = sum(a.count * a.cpus for a in asks if a is not workers)
        fit = math.floor((cluster.free.get("CPU", 0.0) - others) / workers.cpus + 1e-9)
        if 1 <= fit < workers.count:
            out.append(f"lower --rollout.num_workers to {fit}")
        out.append("--rollout.worker_num_cpus")
    out.append("--placement.trainer_ranks or --placement.cpus_per_rank")
    if any(a.what == "engine bundles" for a in asks):
        out.append("--placement.engines / engine_gpus")
    if any(a.what == "reward workers" for a in asks):
        out.append("--reward_worker.num_cpus / num_gpus")
    return ", or ".join(out) + ", or add nodes to the cluster"


def cluster_address(cfg: TrainConfig) -> str | None:
    """The existing Ray cluster the run attaches to (None: it starts its own)."""
    return cfg.rollout.ray_address or os.environ.get("RAY_ADDRESS") or None


def check_cluster_fit(cfg: TrainConfig) -> None:
    """Raise `ConfigError` with the numbers when the run's Ray requests do not fit the free
    resources of the cluster it attaches to; connects to that cluster (the run's later Ray
    calls use the connection). Nothing to check without asks or without an existing cluster."""
    asks = run_asks(cfg)
    address = cluster_address(cfg)
    if not asks:
        return
    import ray

    if not ray.is_initialized():
        if address is None:
            return  # the run starts (and sizes) its own cluster
        ray.init(address=address, include_dashboard=False)
    from palaestra.ray_capacity import cluster_view

    cluster = cluster_view()
    problems = shortfalls(asks, cluster)
    if problems:
        where = f"the Ray cluster at {address}" if address else "the Ray cluster"
        fix = remedies(asks, cluster)
        raise ConfigError(f"{where} cannot place this run's actors (Ray would leave them "
                          f"pending): the run {'; and the run '.join(problems)}. "
                          f"{fix[0].upper()}{fix[1:]}.")


__all__ = ["check_cluster_fit", "cluster_address", "remedies", "run_asks"]

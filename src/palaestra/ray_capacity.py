"""What a Ray cluster has, set against what a run asks of it: the numbers a refusal gives.

A Ray actor or placement group that asks more CPUs or GPUs than the cluster has free is not an
error to Ray: it waits, ``PENDING_CREATION``, for a node that may never come, and a run waiting
on it hangs without a word. This module gives the run the numbers to say so instead:

- `Ask`: one kind of request (``2 trainer ranks x 1 CPU``), as bundles of a placement group or
  as plain actors (each must fit on one node either way);
- `ClusterView`: the alive nodes' CPUs and GPUs and what is free now (`cluster_view` reads them
  from the connected Ray cluster);
- `shortfalls`: every way a list of asks does not fit a view (pure: tested without Ray);
- `actor_states`: what Ray says of actors that have not answered (``PENDING_CREATION``...).

Ray is imported only inside the functions that talk to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

RESOURCES = ("CPU", "GPU")


@dataclass(frozen=True)
class Ask:
    """``count`` Ray requests of ``cpus`` CPUs and ``gpus`` GPUs each, for ``what``."""

    what: str  # plural noun of one request: "trainer ranks", "rollout workers"
    count: int
    cpus: float
    gpus: float = 0.0
    bundled: bool = False  # bundles of a placement group (reserved together, before the run)

    def amount(self, key: str) -> float:
        return self.cpus if key == "CPU" else self.gpus

    def describe(self, key: str) -> str:
        where = " (placement group bundles)" if self.bundled else ""
        return f"{self.count} {self.what} x {self.amount(key):g}{where}"


@dataclass(frozen=True)
class ClusterView:
    """The alive nodes' resources (``[{"CPU": 2.0, ...}, ...]``) and the cluster's free ones."""

    nodes: tuple[dict[str, float], ...]
    free: dict[str, float] = field(default_factory=dict)

    def total(self, key: str) -> float:
        return sum(n.get(key, 0.0) for n in self.nodes)

    def describe(self, key: str) -> str:
        """``4 CPUs (2 nodes: 2 + 2), 4 free``."""
        per_node = " + ".join(f"{n.get(key, 0.0):g}" for n in self.nodes)
        count = len(self.nodes)
        return (f"{self.total(key):g} {key}s ({count} node{'s' if count != 1 else ''}: "
                f"{per_node}), {self.free.get(key, 0.0):g} free")


def shortfalls(asks: Sequence[Ask], cluster: ClusterView) -> list[str]:
    """Every way ``asks`` do not fit ``cluster`` (empty: they fit): a total above what is free,
    or one request larger than every node (Ray places a bundle or an actor on one node)."""
    out = []
    for key in RESOURCES:
        parts = [a for a in asks if a.count and a.amount(key) > 0]
        need = sum(a.count * a.amount(key) for a in parts)
        if need > cluster.free.get(key, 0.0) + 1e-9:
            out.append(f"needs {need:g} {key}s: {' + '.join(a.describe(key) for a in parts)}; "
                       f"the cluster has {cluster.describe(key)}")
        largest = max((n.get(key, 0.0) for n in cluster.nodes), default=0.0)
        for a in parts:
            if a.amount(key) > largest + 1e-9:
                out.append(f"one of the {a.what} asks {a.amount(key):g} {key}s but the largest "
                           f"node has {largest:g} (a request is placed on one node)")
    return out


def cluster_view() -> ClusterView:
    """The connected Ray cluster's alive nodes and free resources."""
    import ray

    nodes = tuple({k: float(v) for k, v in n.get("Resources", {}).items() if k in RESOURCES}
                  for n in ray.nodes() if n.get("Alive"))
    free = {k: float(v) for k, v in ray.available_resources().items() if k in RESOURCES}
    return ClusterView(nodes, free)


def actor_states(actors: Sequence[Any]) -> list[str]:
    """Ray's state of each actor handle (``PENDING_CREATION``, ``ALIVE``...; "unknown" where the
    actor table cannot say: it is Ray's internal GCS view, read without the dashboard)."""
    try:
        from ray._private import state
    except ImportError:
        return ["unknown"] * len(actors)
    out = []
    for actor in actors:
        try:
            out.append(str(state.actors(actor._actor_id.hex()).get("State", "unknown")))
        except Exception:  # noqa: BLE001 - a best-effort detail of an error message
            out.append("unknown")
    return out


__all__ = ["RESOURCES", "Ask", "ClusterView", "actor_states", "cluster_view", "shortfalls"]

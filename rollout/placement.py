"""GPU placement of trainer and engines: a pure plan (`plan_placement`), then Ray placement groups.

*Colocated*: trainer and engines share the same GPUs (one bundle per GPU; the trainer actor and
the engine on a GPU each ask for half of it; engines release their memory while the trainer
steps and resume it afterwards). *Disaggregated*: the first ``trainer_gpus`` bundles train, the
next ``engine_gpus`` serve, and weights travel by NCCL broadcast. Engines span ``engine_tp``
consecutive bundles, never across a node boundary. The plan is plain data (tested without GPUs);
`create_placement_group` turns it into a Ray placement group once GPUs exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from palaestra.errors import ConfigError


@dataclass(frozen=True)
class PlacementConfig:
    """How many GPUs the trainer and the engines get, and whether they share them."""

    trainer_gpus: int
    engine_gpus: int
    engine_tp: int = 1
    colocate: bool = False
    gpus_per_node: int = 8
    num_gpus: int | None = None  # GPUs available (None: exactly what the plan needs)
    cpus_per_bundle: float = 1.0


@dataclass(frozen=True)
class PlacementPlan:
    """Bundles of one placement group and which role uses which bundle."""

    bundles: tuple[dict[str, float], ...]
    trainer_bundles: tuple[int, ...]
    engine_bundles: tuple[tuple[int, ...], ...]  # per engine, its tensor-parallel bundles
    trainer_gpu_fraction: float  # num_gpus a trainer actor asks of its bundle
    engine_gpu_fraction: float  # num_gpus an engine actor asks of each of its bundles
    colocate: bool
    strategy: str = "PACK"

    @property
    def num_gpus(self) -> int:
        return int(sum(b.get("GPU", 0) for b in self.bundles))

    def describe(self) -> str:
        mode = "colocated" if self.colocate else "disaggregated"
        engines = ", ".join(f"e{i}:{list(b)}" for i, b in enumerate(self.engine_bundles))
        return (
            f"{mode}, {self.num_gpus} GPUs: trainer on bundles {list(self.trainer_bundles)}; "
            f"engines {engines}"
        )


def plan_placement(config: PlacementConfig | dict[str, Any]) -> PlacementPlan:
    """Check the GPU budget and lay trainer and engines out on bundles (no Ray, no GPUs)."""
    cfg = config if isinstance(config, PlacementConfig) else PlacementConfig(**config)
    problems = []
    if cfg.trainer_gpus < 1:
        problems.append(f"trainer_gpus must be >= 1 (got {cfg.trainer_gpus})")
    if cfg.engine_gpus < 1:
        problems.append(f"engine_gpus must be >= 1 (got {cfg.engine_gpus})")
    if cfg.engine_tp < 1 or (cfg.engine_gpus >= 1 and cfg.engine_gpus % cfg.engine_tp):
        problems.append(
            f"engine_gpus ({cfg.engine_gpus}) must be a multiple of engine_tp ({cfg.engine_tp})"
        )
    if cfg.engine_tp > cfg.gpus_per_node:
        problems.append(
            f"engine_tp ({cfg.engine_tp}) exceeds gpus_per_node ({cfg.gpus_per_node}); a "
            "tensor-parallel engine must fit in one node"
        )
    if cfg.colocate and cfg.engine_gpus != cfg.trainer_gpus:
        problems.append(
            f"colocated runs share every GPU: engine_gpus ({cfg.engine_gpus}) must equal "
            f"trainer_gpus ({cfg.trainer_gpus})"
        )
    needed = cfg.trainer_gpus if cfg.colocate else cfg.trainer_gpus + cfg.engine_gpus
    if cfg.num_gpus is not None and needed > cfg.num_gpus:
        problems.append(
            f"the plan needs {needed} GPUs but only {cfg.num_gpus} are available; lower "
            "trainer_gpus/engine_gpus or colocate"
        )
    if problems:
        raise ConfigError("invalid GPU placement:\n  - " + "\n  - ".join(problems))
    bundle = {"GPU": 1.0, "CPU": float(cfg.cpus_per_bundle)}
    bundles = tuple(dict(bundle) for _ in range(needed))
    first_engine = 0 if cfg.colocate else cfg.trainer_gpus
    engines = []
    for e in range(cfg.engine_gpus // cfg.engine_tp):
        start = first_engine + e * cfg.engine_tp
        span = tuple(range(start, start + cfg.engine_tp))
        if span[0] // cfg.gpus_per_node != span[-1] // cfg.gpus_per_node:
            raise ConfigError(
                f"engine {e} would span bundles {list(span)} across a node boundary "
                f"(gpus_per_node={cfg.gpus_per_node}); make trainer_gpus a multiple of engine_tp"
            )
        engines.append(span)
    share = 0.5 if cfg.colocate else 1.0
    return PlacementPlan(
        bundles=bundles,
        trainer_bundles=tuple(range(cfg.trainer_gpus)),
        engine_bundles=tuple(engines),
        trainer_gpu_fraction=share,
        engine_gpu_fraction=share,
        colocate=cfg.colocate,
    )


def create_placement_group(plan: PlacementPlan, timeout_s: float = 120.0) -> Any:
    """Reserve the plan's bundles in the Ray cluster (fails clearly without enough GPUs)."""
    import ray
    from ray.util.placement_group import placement_group

    available = int(ray.cluster_resources().get("GPU", 0))
    if available < plan.num_gpus:
        raise ConfigError(
            f"the placement needs {plan.num_gpus} GPUs but the Ray cluster has {available}; "
            "start Ray on GPU nodes (or use the CPU path: one LocalEngine, no placement group)"
        )
    group = placement_group(list(plan.bundles), strategy=plan.strategy)
    ray.get(group.ready(), timeout=timeout_s)
    return group


def describe_for_train_config(cfg: Any) -> str:
    """One line for ``palaestra train --dry-run``: the plan of the config's ``placement`` section
    (fields of `PlacementConfig`), or the single-process CPU layout when there is none."""
    section = getattr(cfg, "placement", None)
    if section is None:
        return "placement: single process (CPU; no GPU placement configured)"
    fields = section.model_dump() if hasattr(section, "model_dump") else dict(section)
    return "placement: " + plan_placement(PlacementConfig(**fields)).describe()


__all__ = [
    "PlacementConfig",
    "PlacementPlan",
    "create_placement_group",
    "describe_for_train_config",
    "plan_placement",
]

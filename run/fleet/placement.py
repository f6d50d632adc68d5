"""GPU placement of trainer and engines: a pure plan (`plan_placement`), then Ray placement groups.

*Colocated*: trainer and engines share the same GPUs (one bundle per GPU; the trainer actor and
the engine on a GPU each ask for half of it; engines release their memory while the trainer
steps and resume it afterwards). *Disaggregated*: the first ``trainer_gpus`` bundles train, the
next ``engine_gpus`` serve, and weights travel by NCCL broadcast. Engines span ``engine_tp``
consecutive bundles, never across a node boundary. The plan is plain data (tested without GPUs);
`create_placement_group` turns it into a Ray placement group once GPUs exist.

`PlacementSection` is the ``[placement]`` section of ``TrainConfig`` (nodes, GPUs per node,
trainer ranks, engine GPUs and tensor parallelism, colocation, where a critic and a reference go);
`plan_run` turns it into a `RunPlan` (bundles per node, trainer ranks, engines) or lists every
reason the layout is impossible. On CPU nodes (``gpus_per_node = 0``, or a trainer on
``device = "cpu"``) the trainer ranks get CPU bundles, and ``engines = N`` adds N CPU bundles
for embedded engines (``palaestra serve``) as Ray actors (colocated: engine i shares rank i's
bundle instead, as on GPUs, `RunPlan.shares_bundles`); without it the engines stay as
``[engine]`` says (embedded in the driver, or servers at ``engine.urls``). The engine bundles
of a plan are where `palaestra.run.fleet.actors` starts its engine actors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from palaestra.config import Section
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
    if isinstance(section, PlacementSection):
        on_gpu = section.gpus_per_node > 0 and getattr(
            getattr(getattr(cfg, "trainer", None), "torch", None), "device", "auto") != "cpu"
        return plan_run(section, on_gpu=on_gpu).describe_lines()[0]
    fields = section.model_dump() if hasattr(section, "model_dump") else dict(section)
    return "placement: " + plan_placement(PlacementConfig(**fields)).describe()


class PlacementSection(Section):
    """``[placement]``: where the trainer ranks and the engines of a run go."""

    nodes: int = Field(1, ge=1)
    """Nodes of the Ray cluster the run uses."""
    gpus_per_node: int = Field(8, ge=0)
    """GPUs of one node (0: CPU nodes; the trainer ranks get CPU bundles)."""
    trainer_ranks: int = Field(1, ge=1)
    """Trainer processes (one GPU each on GPU nodes). Torch backend: FSDP2 data-parallel ranks;
    Megatron: tp x pp x dp with tp/pp/ep from ``trainer.megatron``. More than one runs the
    trainer as a group of Ray actors on a placement group; 1 trains in the driver process."""
    engine_gpus: int = Field(0, ge=0)
    """GPUs of the inference engines, each engine a Ray actor on its ``engine_tp`` bundles
    serving the embedded engine (``palaestra serve``) or SGLang (0: the engines of
    ``[engine]``: the embedded one in the driver, or servers at ``engine.urls``)."""
    engines: int = Field(0, ge=0)
    """CPU nodes only: embedded engines (``palaestra serve``), each a Ray actor on a CPU bundle
    of ``cpus_per_engine`` (0: the engines of ``[engine]``). On GPU nodes the engine count is
    ``engine_gpus / engine_tp``."""
    cpus_per_engine: float = Field(1.0, gt=0.0)
    """CPUs an engine's bundle reserves (CPU engines; GPU engines reserve ``cpus_per_rank``)."""
    engine_tp: int = Field(1, ge=1)
    """Tensor parallelism of one engine (an engine never spans nodes)."""
    colocate: bool = False
    """Trainer and engines share the same GPUs, time-sliced (engine_gpus = trainer_ranks)."""
    critic_ranks: int = Field(0, ge=0)
    """GPUs of a separate critic (0: the critic, if any, shares the policy's ranks)."""
    reference_ranks: int = Field(0, ge=0)
    """GPUs of a separate reference model (0: on the policy's ranks)."""
    cpus_per_rank: float = Field(1.0, gt=0.0)
    """CPUs a trainer rank's bundle reserves."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement-group strategy (PACK fills a node first; SPREAD spreads ranks over nodes)."""
    gpu_memory_gib: float = Field(139.0, gt=0.0)
    """Memory of one GPU for the dry run's estimate (139: an H200)."""
    model_shape: str | None = None
    """A named shape for the dry run's estimate when ``model.path`` holds no config.json."""


@dataclass(frozen=True)
class RunPlan:
    """The bundles of a run's placement group and the role of each."""

    bundles: tuple[dict[str, float], ...]
    node_of_bundle: tuple[int | None, ...]  # None: wherever Ray finds room (CPU bundles)
    trainer_bundles: tuple[int, ...]  # bundle of trainer rank r
    critic_bundles: tuple[int, ...]
    reference_bundles: tuple[int, ...]
    engine_bundles: tuple[tuple[int, ...], ...]
    on_gpu: bool
    colocate: bool
    layout: dict[str, int]  # fsdp=N (torch) or tp/pp/dp/ep (megatron)
    trainer_gpu_fraction: float
    strategy: str = "PACK"
    trainer_cpus: float = 1.0  # CPUs a trainer rank's actor asks of its bundle
    engine_cpus: float = 0.5  # CPUs an engine actor asks of its first bundle

    @property
    def num_gpus(self) -> int:
        return int(sum(b.get("GPU", 0) for b in self.bundles))

    @property
    def shares_bundles(self) -> bool:
        """Colocated engines on the trainer ranks' own bundles: engine i's first bundle is a
        trainer rank's, so the trainer group and the engines need one placement group."""
        ranks = set(self.trainer_bundles)
        return self.colocate and bool(self.engine_bundles) and all(
            span[0] in ranks for span in self.engine_bundles)

    @property
    def engine_gpu_fraction(self) -> float:
        """The GPU an engine actor asks of each of its bundles (0 on CPU bundles)."""
        if not self.on_gpu:
            return 0.0
        return self.trainer_gpu_fraction if self.colocate else 1.0

    def roles(self, bundle: int) -> list[str]:
        out = [f"trainer rank {r}" for r, b in enumerate(self.trainer_bundles) if b == bundle]
        out += [f"critic rank {r}" for r, b in enumerate(self.critic_bundles) if b == bundle]
        out += [f"reference rank {r}" for r, b in enumerate(self.reference_bundles) if b == bundle]
        out += [f"engine {e}" for e, span in enumerate(self.engine_bundles) if bundle in span]
        return out

    def describe_lines(self) -> list[str]:
        layout = " x ".join(f"{k} {v}" for k, v in self.layout.items())
        kind = "GPU" if self.on_gpu else "CPU"
        mode = "colocated" if self.colocate else "disaggregated"
        head = (f"placement: {mode}, {len(self.trainer_bundles)} trainer rank(s) ({layout}) on "
                f"{kind} bundles, {len(self.engine_bundles)} engine(s) in the plan, "
                f"{self.num_gpus} GPUs, strategy {self.strategy}")
        lines = [head]
        nodes = sorted({n for n in self.node_of_bundle if n is not None})
        for node in nodes:
            idx = [i for i, n in enumerate(self.node_of_bundle) if n == node]
            lines.append(f"  node {node}: bundles {idx}")
        loose = [i for i, n in enumerate(self.node_of_bundle) if n is None]
        if loose:
            lines.append(f"  any node: bundles {loose}")
        for i, bundle in enumerate(self.bundles):
            res = ", ".join(f"{k} {v:g}" for k, v in bundle.items())
            lines.append(f"  bundle {i} [{res}]: {' + '.join(self.roles(i))}")
        return lines


def plan_problems(section: PlacementSection, *, on_gpu: bool, model_parallel: int = 1,
                  expert_parallel: int = 1) -> list[str]:
    """Every reason the layout is impossible (empty: `plan_run` succeeds)."""
    s, out = section, []
    ranks = s.trainer_ranks
    if ranks % model_parallel:
        out.append(f"placement.trainer_ranks ({ranks}) must be a multiple of the trainer's model "
                   f"parallelism ({model_parallel}: trainer.megatron.tp x pp)")
    elif (ranks // model_parallel) % expert_parallel:
        out.append(f"the data-parallel size ({ranks // model_parallel}) must be a multiple of "
                   f"trainer.megatron.ep ({expert_parallel})")
    if not on_gpu:
        if s.colocate and s.engines not in (0, ranks):
            out.append(f"colocated CPU engines share the trainer ranks' bundles (engine i on rank "
                       f"i's): placement.engines ({s.engines}) must equal trainer_ranks "
                       f"({ranks}), or set colocate = false")
        if s.engine_gpus:
            out.append(f"placement.engine_gpus = {s.engine_gpus} on CPU nodes (gpus_per_node = 0 "
                       "or trainer device cpu): engines on CPU are placement.engines = N "
                       "(embedded engines as Ray actors), the embedded engine or engine.urls; "
                       "set engine_gpus = 0")
        # colocate on CPU: the phases switch as on a GPU (the engine frees its KV cache, the
        # trainer's offload moves nothing); it checks a colocated recipe on a CPU machine
        return out
    if s.gpus_per_node < 1:
        out.append("a GPU placement needs placement.gpus_per_node >= 1")
        return out
    if s.engines:
        out.append(f"placement.engines = {s.engines} counts CPU engines; on GPU nodes the "
                   f"engines are placement.engine_gpus / engine_tp: set engines = 0")
    if s.engine_gpus % s.engine_tp:
        out.append(f"placement.engine_gpus ({s.engine_gpus}) must be a multiple of "
                   f"placement.engine_tp ({s.engine_tp})")
    if s.engine_tp > s.gpus_per_node:
        out.append(f"placement.engine_tp ({s.engine_tp}) exceeds gpus_per_node "
                   f"({s.gpus_per_node}); a tensor-parallel engine must fit in one node")
    if s.colocate and s.engine_gpus not in (0, ranks):
        out.append(f"colocated runs share every trainer GPU: placement.engine_gpus "
                   f"({s.engine_gpus}) must equal trainer_ranks ({ranks}) (or 0: the same)")
    need = _gpus_needed(s)
    have = s.nodes * s.gpus_per_node
    if need > have:
        out.append(f"the plan needs {need} GPUs (trainer {ranks}, critic {s.critic_ranks}, "
                   f"reference {s.reference_ranks}, engines "
                   f"{0 if s.colocate else s.engine_gpus}) but {s.nodes} node(s) x "
                   f"{s.gpus_per_node} GPUs have {have}; lower them, colocate or add nodes")
    elif not out:
        first = need - (0 if s.colocate else s.engine_gpus)
        if s.colocate:
            first = 0
        for e in range(s.engine_gpus // s.engine_tp if not s.colocate else 0):
            start = first + e * s.engine_tp
            if start // s.gpus_per_node != (start + s.engine_tp - 1) // s.gpus_per_node:
                out.append(f"engine {e} would span GPUs {start}..{start + s.engine_tp - 1} across "
                           f"a node boundary (gpus_per_node {s.gpus_per_node}); make the GPUs "
                           f"before the engines (trainer + critic + reference = {first}) a "
                           f"multiple of engine_tp")
                break
    return out


def _gpus_needed(s: PlacementSection) -> int:
    train = s.trainer_ranks + s.critic_ranks + s.reference_ranks
    return train if s.colocate else train + s.engine_gpus


def plan_run(section: PlacementSection, *, on_gpu: bool, model_parallel: int = 1,
             expert_parallel: int = 1, backend: str = "torch",
             tp: int = 1, pp: int = 1) -> RunPlan:
    """Lay the section out on bundles, or raise `ConfigError` with every problem."""
    problems = plan_problems(section, on_gpu=on_gpu, model_parallel=model_parallel,
                             expert_parallel=expert_parallel)
    if problems:
        raise ConfigError("impossible placement:\n  - " + "\n  - ".join(problems))
    s = section
    if backend == "megatron":
        layout = {"tp": tp, "pp": pp, "dp": s.trainer_ranks // (tp * pp), "ep": expert_parallel}
    else:
        layout = {"fsdp": s.trainer_ranks}
    ranks = s.trainer_ranks
    if not on_gpu and s.colocate and s.engines:  # engine i shares trainer rank i's bundle
        bundles = tuple({"CPU": s.cpus_per_rank + s.cpus_per_engine} for _ in range(ranks))
        return RunPlan(bundles, (None,) * ranks, tuple(range(ranks)), (), (),
                       tuple((e,) for e in range(ranks)), False, True, layout, 0.0, s.strategy,
                       s.cpus_per_rank, s.cpus_per_engine)
    if not on_gpu:  # trainer ranks, then the CPU engines (one bundle each)
        bundles = tuple([{"CPU": s.cpus_per_rank} for _ in range(ranks)]
                        + [{"CPU": s.cpus_per_engine} for _ in range(s.engines)])
        engines_cpu = tuple((ranks + e,) for e in range(s.engines))
        return RunPlan(bundles, (None,) * len(bundles), tuple(range(ranks)), (), (),
                       engines_cpu, False, s.colocate, layout, 0.0, s.strategy,
                       s.cpus_per_rank, min(s.cpus_per_engine, 1.0))
    need = _gpus_needed(s)
    engine_cpus = 0.5  # a GPU engine's actor (its server's CPUs are the node's)
    # colocated: a trainer rank's bundle also holds the engine actor beside it
    cpus = s.cpus_per_rank + (engine_cpus if s.colocate else 0.0)
    bundles = tuple({"GPU": 1.0, "CPU": cpus} for _ in range(need))
    nodes = tuple(g // s.gpus_per_node for g in range(need))
    trainer = tuple(range(ranks))
    critic = tuple(range(ranks, ranks + s.critic_ranks))
    ref_start = ranks + s.critic_ranks
    reference = tuple(range(ref_start, ref_start + s.reference_ranks))
    engine_gpus = (s.engine_gpus or ranks) if s.colocate else s.engine_gpus
    first = 0 if s.colocate else ref_start + s.reference_ranks
    engines = tuple(tuple(range(first + e * s.engine_tp, first + (e + 1) * s.engine_tp))
                    for e in range(engine_gpus // s.engine_tp))
    share = 0.5 if s.colocate else 1.0
    return RunPlan(bundles, nodes, trainer, critic, reference, engines, True, s.colocate, layout,
                   share, s.strategy, s.cpus_per_rank, engine_cpus)


__all__ = [
    "PlacementConfig",
    "PlacementPlan",
    "PlacementSection",
    "RunPlan",
    "create_placement_group",
    "describe_for_train_config",
    "plan_placement",
    "plan_problems",
    "plan_run",
]

"""The engines of a run that ``[placement]`` asks for: Ray actors on the plan's engine bundles.

`engine_actor_count` says whether a run starts engine actors: ``placement.engine_gpus > 0`` on
GPU nodes (``engine_gpus / engine_tp`` engines) or ``placement.engines = N`` on CPU nodes, with
``engine.kind = "local"`` (each actor serves the embedded engine with ``palaestra serve``) or
``"sglang"`` (``sglang.launch_server``), and neither ``engine.urls`` nor ``engine.launch`` (those
engines are the run's then, and the plan only estimates). `start_engine_actors` starts them
(`palaestra.run.fleet.actors.EngineGroup`) and returns an `ActorEngine` over their URLs with
the ``[engine]`` section the run then uses for them (`served_section`: servers, so the weights go
by ``engine.weight_sync`` to servers, not in process). `engine_actor_problems` are the load-time
checks. Colocated engine actors beside a trainer group (`shares_trainer_bundles`) reserve one
placement group for both, which `trainer_placement_group` hands to the trainer group. Torch-free
and Ray-free at import.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from palaestra.config import Problem

if TYPE_CHECKING:
    from palaestra.run.fleet.actors import ActorEngine
    from palaestra.run.fleet.placement import RunPlan
    from palaestra.run.sections import EngineSection, RunSettings


def engine_actor_count(cfg: RunSettings) -> int:
    """Engines this run starts as Ray actors (0: the engines of ``[engine]``)."""
    from palaestra.run.trainer_plan import trainer_on_gpu

    p, e = cfg.placement, cfg.engine
    if p is None or cfg.algorithm != "rl" or e.urls or e.launch != "none":
        return 0
    if trainer_on_gpu(cfg):
        return p.engine_gpus // p.engine_tp if p.engine_gpus else 0
    return p.engines


def engine_actor_problems(cfg: RunSettings) -> list[Problem]:
    """Why the engine actors of ``[placement]`` cannot start (checked when the config loads)."""
    p, e = cfg.placement, cfg.engine
    if p is None:
        return []
    out = []
    asked = p.engines or p.engine_gpus
    if asked and (e.urls or e.launch != "none"):
        if p.engines:  # engine_gpus with urls stays an estimate (the recipes' GPU plans)
            out.append(Problem(("placement.engines", "engine.urls", "engine.launch"), (
                f"placement.engines = {p.engines} starts the run's engines as Ray actors, and "
                "engine.urls / engine.launch name engines too: keep one of them")))
        return out
    count = engine_actor_count(cfg)
    if not count:
        return out
    if e.kind == "local" and p.engine_tp > 1:
        out.append(Problem(("placement.engine_tp", "engine.kind"), (
            f"placement.engine_tp = {p.engine_tp}: the embedded engine (engine.kind = 'local') "
            "serves on one GPU; set engine_tp = 1, or engine.kind = 'sglang' for "
            "tensor-parallel engines")))
    if e.kind == "sglang" and not p.engine_gpus:
        out.append(Problem(("placement.engines", "engine.kind"), (
            "placement.engines on CPU nodes starts embedded engines (palaestra serve); SGLang "
            "needs GPUs: set engine.kind = 'local', or GPU nodes with placement.engine_gpus")))
    if e.weight_sync.kind == "in_process":
        out.append(Problem(("engine.weight_sync.kind", "placement"), (
            "engine actors are servers in their own processes: the weights cannot go in process; "
            "set engine.weight_sync.kind = 'auto' (distributed on GPUs, disk on CPU), "
            "'distributed', 'disk' or 'tensor'")))
    return out


def shares_trainer_bundles(cfg: RunSettings, plan: RunPlan) -> bool:
    """Whether the engine actors and the trainer group share one placement group: colocated
    engine actors beside a trainer group (engine i on trainer rank i's bundles)."""
    return (engine_actor_count(cfg) > 0 and cfg.placement is not None
            and cfg.placement.trainer_ranks > 1 and plan.shares_bundles)


def trainer_placement_group(engine: object) -> object | None:
    """The placement group a trainer group starts its ranks in: the one the run's engine
    actors reserved for both (a colocated plan), else None (the group reserves its own)."""
    from palaestra.run.fleet.actors import actor_group_of

    group = actor_group_of(engine)
    return None if group is None else group.placement_group


def engine_actor_lines(cfg: RunSettings, plan: RunPlan) -> list[str]:
    """``--dry-run``: the engine actors the run starts, one line each (none: what serves)."""
    count = engine_actor_count(cfg)
    if not count:
        if plan.engine_bundles:
            return [(f"engines: not started from the plan (the engines of [engine]: "
                     f"{'engine.urls' if cfg.engine.urls else cfg.engine.kind}); the plan's "
                     "engine bundles are an estimate")]
        return []
    server = "sglang.launch_server" if cfg.engine.kind == "sglang" else "palaestra serve"
    where = "GPU" if plan.on_gpu else "CPU"
    lines = [(f"engines: {count} Ray actor(s), each serving {server} on its {where} "
              "bundle(s); the run routes over their URLs (weights by engine.weight_sync to "
              "servers)")]
    if shares_trainer_bundles(cfg, plan):
        lines.append(f"  one placement group for the trainer group and the engines: each "
                     f"engine actor asks {plan.engine_gpu_fraction:g} GPU and "
                     f"{plan.engine_cpus:g} CPU of its trainer rank's bundle")
    for e, span in enumerate(plan.engine_bundles):
        extra = ""
        if cfg.engine.kind == "sglang":
            extra = f" --tp-size {len(span)}" + (" --enable-memory-saver" if plan.colocate
                                                 else "")
        lines.append(f"  engine actor {e}: bundles {list(span)}{extra}")
    return lines


def served_section(engine: EngineSection) -> EngineSection:
    """``[engine]`` as the run uses it for engine actors: servers (``kind = "sglang"``)."""
    return engine.model_copy(update={"kind": "sglang"})


def _serve_args(cfg: RunSettings) -> tuple[str, ...]:
    """The server's own settings from ``[engine]`` (the launch args win when they set one)."""
    given = list(cfg.engine.launch_args)
    if cfg.engine.kind == "sglang":
        return tuple(given)
    extra = []
    for flag, value in (("--max-running", cfg.engine.max_running),
                        ("--max-model-len", cfg.agent.max_context), ("--seed", cfg.seed)):
        if flag not in given:
            extra += [flag, str(value)]
    return tuple(given + extra)


async def start_engine_actors(cfg: RunSettings, model_path: Path
                              ) -> tuple[EngineSection, ActorEngine] | None:
    """Start the run's engine actors (None when ``[placement]`` asks for none): the section the
    run uses for them and an engine over their servers (closing it stops the actors)."""
    if not engine_actor_count(cfg):
        return None
    from palaestra.run.fleet.actors import ActorEngine, EngineGroup
    from palaestra.run.fleet.engine_actor import EngineLaunch
    from palaestra.run.trainer_plan import require_plan

    plan = require_plan(cfg)
    p, r = cfg.placement, cfg.rollout
    assert p is not None
    launch = EngineLaunch(
        str(model_path), server="sglang" if cfg.engine.kind == "sglang" else "palaestra",
        colocate=plan.colocate, extra_args=_serve_args(cfg),
        log_dir=str(Path(cfg.out) / "servers"), cpus_per_engine=p.cpus_per_engine)
    group = EngineGroup(launch, address=r.ray_address)
    workers = r.num_workers * r.worker_num_cpus if r.cluster == "ray" else 0.0
    trainer = p.trainer_ranks * p.cpus_per_rank if p.trainer_ranks > 1 else 0.0
    await group.start(plan, extra_cpus=workers + trainer,
                      shared=shares_trainer_bundles(cfg, plan))
    return served_section(cfg.engine), ActorEngine(group)


__all__ = ["engine_actor_count", "engine_actor_lines", "engine_actor_problems", "served_section",
           "shares_trainer_bundles", "start_engine_actors", "trainer_placement_group"]

"""The run's placement plan from a `RunSettings` (no Ray, no torch): what the trainer group and
``--dry-run`` use, and the load-time checks of ``[placement]`` (`placement_problems`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from palaestra.config import Problem
from palaestra.errors import ConfigError

if TYPE_CHECKING:
    from palaestra.run.fleet.placement import RunPlan
    from palaestra.run.sections import RunSettings


def trainer_on_gpu(cfg: RunSettings) -> bool:
    """Whether trainer ranks get GPU bundles: GPU nodes and a trainer not pinned to the CPU."""
    p = cfg.placement
    if p is None or p.gpus_per_node == 0:
        return False
    return cfg.trainer.backend == "megatron" or cfg.trainer.torch.device != "cpu"


def _parallel(cfg: RunSettings) -> dict[str, int]:
    if cfg.trainer.backend == "megatron":
        m = cfg.trainer.megatron
        return {"model_parallel": m.tp * m.pp, "expert_parallel": getattr(m, "ep", 1) or 1,
                "tp": m.tp, "pp": m.pp}
    return {"model_parallel": 1, "expert_parallel": 1, "tp": 1, "pp": 1}


def run_plan(cfg: RunSettings) -> RunPlan | None:
    """The plan of ``cfg.placement`` (None without one); raises `ConfigError` when impossible."""
    from palaestra.run.fleet.placement import plan_run

    if cfg.placement is None:
        return None
    return plan_run(cfg.placement, on_gpu=trainer_on_gpu(cfg), backend=cfg.trainer.backend,
                    **_parallel(cfg))


def group_size(cfg: RunSettings) -> int:
    """Trainer ranks of the run (1: the backend lives in the driver process)."""
    return 1 if cfg.placement is None else cfg.placement.trainer_ranks


def placement_problems(cfg: RunSettings) -> list[Problem]:
    """Why ``[placement]`` cannot run (checked when the config loads, dry run included)."""
    from palaestra.run.fleet.placement import plan_problems

    p = cfg.placement
    if p is None:
        return []
    par = _parallel(cfg)
    out = [Problem(("placement",), msg) for msg in plan_problems(
        p, on_gpu=trainer_on_gpu(cfg), model_parallel=par["model_parallel"],
        expert_parallel=par["expert_parallel"])]
    if p.trainer_ranks > 1 and cfg.trainer.backend == "megatron":
        if not trainer_on_gpu(cfg):
            out.append(Problem(("placement.trainer_ranks", "trainer.backend"), (
                f"placement.trainer_ranks = {p.trainer_ranks} with trainer.backend = "
                "'megatron' on CPU nodes: Megatron-core trains on CUDA GPUs; set "
                "placement.gpus_per_node >= 1, or trainer.backend = 'torch' (FSDP2 on CPU)")))
        if cfg.trainer.megatron.pp > 1:
            out.append(Problem(("placement.trainer_ranks", "trainer.megatron.pp"), (
                f"trainer.megatron.pp = {cfg.trainer.megatron.pp} in a trainer group: engine "
                "weights are pushed from rank 0, which holds only the first pipeline stage; "
                "use tp/ep/dp in a group, or pipeline parallelism under torchrun "
                "(docs/megatron.md)")))
    if p.colocate and cfg.rollout.mode == "async":
        out.append(Problem(("placement.colocate", "rollout.mode"), (
            "placement.colocate = true with rollout.mode = 'async': a colocated GPU serves or "
            "trains, never both at once (the phases are time-sliced, so nothing could generate "
            "while a step trains); set rollout.mode = 'sync' or placement.colocate = false")))
    if p.trainer_ranks > 1 and cfg.algorithm != "rl":
        out.append(Problem(("placement.trainer_ranks", "algorithm"), (
            f"placement.trainer_ranks = {p.trainer_ranks} with algorithm = {cfg.algorithm!r}: "
            "offline SFT/DPO trains in one process; set trainer_ranks = 1")))
    return out


def require_plan(cfg: RunSettings) -> RunPlan:
    plan = run_plan(cfg)
    if plan is None:
        raise ConfigError("a trainer group needs a [placement] section (placement.trainer_ranks)")
    return plan


__all__ = ["group_size", "placement_problems", "require_plan",
           "run_plan", "trainer_on_gpu"]

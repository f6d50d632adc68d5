"""``palaestra train --dry-run``: the resolved config, the GPU placement and a per-GPU memory estimate.

Nothing is started and nothing heavy is imported (no torch, no Ray). The placement comes from
the config's ``[placement]`` section when there is one (`palaestra.run.fleet.placement.
PlacementSection`: nodes, GPUs per node, trainer ranks, engine GPUs and tp, colocation, critic and
reference ranks; `describe_section` prints its bundles per node, ranks, engines and memory per
GPU), else from the environment variables the GPU recipes in ``scripts/`` still set (read only
here, and only without a ``[placement]`` section):

- ``PALAESTRA_TRAINER_GPUS``: GPUs of the trainer (default: ``PALAESTRA_GPUS``)
- ``PALAESTRA_ENGINE_GPUS``: GPUs of the inference engines (default: all of them when
  colocated; ``len(engine.urls) * tp`` for SGLang)
- ``PALAESTRA_ENGINE_TP``: tensor parallelism of one engine (default 1)
- ``PALAESTRA_TRAINER_TP``: model parallelism of the trainer (default: Megatron's tp x pp)
- ``PALAESTRA_COLOCATE``: 1: trainer and engines share GPUs; 0: separate sets
- ``PALAESTRA_GPUS``: GPUs available to the run
- ``PALAESTRA_GPUS_PER_NODE``: GPUs per node (default 8)
- ``PALAESTRA_GPU_MEMORY_GIB``: memory of one GPU in GiB (default 139, an H200)
- ``PALAESTRA_MODEL_SHAPE``: a named shape (`NAMED_SHAPES`) when ``model.path`` holds no
  ``config.json`` and its name names no shape

Without any of them and with the embedded engine the run is one process on one device.

The memory model (documented estimate, not a measurement): training keeps bf16 weights and
fp32 gradients sharded over the trainer's tensor parallelism, an fp32 master copy and two Adam
moments (12 bytes/param) sharded over all trainer GPUs (distributed optimizer / FSDP), and
activations of one micro-batch (34 bytes per token x hidden x layer / tp with flash attention;
with gradient checkpointing the bf16 layer inputs plus one layer) plus its fp32 logits, twice
the training state with a critic; an engine keeps bf16 weights / tp and the KV cache of
every episode of a step in flight at ``agent.max_context`` tokens. Colocated GPUs hold the larger
of the two phases (the engine releases its memory while the trainer steps; the trainer is
offloaded during rollout).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from palaestra.model_shapes import NAMED_SHAPES
from palaestra.run.config import TrainConfig
from palaestra.run.fleet.memory_plan import (
    GIB,
    GpuRow,
    ModelShape,
    _int_env,
    engine_memory,
    format_table,
    placement_fields,
    plan_rows,
    resolve_shape,
    train_memory,
)
from palaestra.run.fleet.sync_settings import DiskSync, DistributedSync


def _engine_line(cfg: TrainConfig) -> str:
    from palaestra.run.fleet.start import engine_actor_count

    e = cfg.engine
    if engine_actor_count(cfg):  # [placement] starts them (see the placement lines)
        return f"{engine_actor_count(cfg)} {e.kind} engine actor(s) of [placement] (servers)"
    if e.kind == "local":
        return "local (in process)"
    parts = [f"at {', '.join(e.urls)}"] if e.urls else []
    if e.launch != "none":
        groups = len(e.launch_gpus) // e.launch_tp if e.launch_gpus else 1
        where = f"GPUs {e.launch_gpus}, tp {e.launch_tp}" if e.launch_gpus else "CPU"
        parts.append(f"launching {groups} {e.launch} server(s) ({where})")
    return "sglang " + " + ".join(parts)


def _sync_line(cfg: TrainConfig) -> str:
    e, sync = cfg.engine, cfg.engine.weight_sync
    method: str = sync.kind
    if method == "auto":
        from palaestra.run.fleet.start import engine_actor_count

        colocated = cfg.placement is not None and cfg.placement.colocate
        method = "in_process" if e.kind == "local" and not engine_actor_count(cfg) else (
            "ipc (CUDA IPC handles, each trainer rank to the engine on its GPU) if CUDA is "
            "here, else disk" if colocated else "distributed if CUDA is here, else disk")
    d = e.sync_settings("distributed") if method.startswith("distributed") else sync
    if e.kind == "sglang" and isinstance(d, DistributedSync):
        method += (f" ({d.backend}, rendezvous {d.master_address}:"
                   f"{d.master_port or 'any port'}, {d.bucket_mb} MB buckets)")
    elif isinstance(sync, DiskSync):
        method += f" ({sync.dir})"
    return method


def describe_section(cfg: TrainConfig, environ: Mapping[str, str]) -> str:
    """The ``[placement]`` plan: bundles per node, trainer ranks and layout, engines, and the
    memory estimate per GPU (per trainer rank in host memory on CPU bundles)."""
    from palaestra.run.trainer_plan import require_plan

    section = cfg.placement
    assert section is not None
    if section.model_shape:
        environ = {**environ, "PALAESTRA_MODEL_SHAPE": section.model_shape}
    shape = resolve_shape(cfg, environ)
    lines = [_shape_line(cfg, shape)]
    plan = require_plan(cfg)
    lines += plan.describe_lines()
    from palaestra.run.fleet.start import engine_actor_lines

    lines += engine_actor_lines(cfg, plan)
    if section.trainer_ranks > 1:
        where = "Ray actors on the placement group's bundles" if plan.on_gpu else \
            "Ray actors on CPU bundles (FSDP2 over gloo)"
        lines.append(f"trainer group: {section.trainer_ranks} ranks as {where}; the warm-start "
                     "SFT phase, if any, trains in the driver process")
    if shape is None:
        return "\n".join(lines)
    tp = plan.layout.get("tp", 1) * plan.layout.get("pp", 1)
    ranks = len(plan.trainer_bundles)
    policy = train_memory(shape, cfg, ranks, tp)
    critic = bool(getattr(cfg.trainer.torch, "critic", False))
    if critic and plan.critic_bundles:  # the critic's copy moves to its own ranks
        policy = {k: (v / 2 if k in ("weights", "grads", "optimizer") else v)
                  for k, v in policy.items()}
    if getattr(cfg.trainer.torch, "ref_model", False) and plan.reference_bundles:
        policy["weights"] -= 2 * shape.params / tp
    if not plan.on_gpu:
        total = sum(policy.values()) / GIB
        lines.append(f"host memory per trainer rank (estimate): {total:.2f} GiB "
                     f"(weights {policy['weights'] / GIB:.2f}, optimizer "
                     f"{policy['optimizer'] / GIB:.2f}, activations "
                     f"{policy['activations'] / GIB:.2f})")
        return "\n".join(lines)
    engine_tp = len(plan.engine_bundles[0]) if plan.engine_bundles else 1
    rows = []
    for i in range(len(plan.bundles)):
        roles = plan.roles(i)
        train: dict[str, float] = {}
        if i in plan.trainer_bundles:
            train = dict(policy)
        elif i in plan.critic_bundles:
            train = {"weights": 2 * shape.params / tp, "grads": 4 * shape.params / tp,
                     "optimizer": 12 * shape.params / len(plan.critic_bundles),
                     "activations": policy["activations"]}
        elif i in plan.reference_bundles:
            train = {"weights": 2 * shape.params / len(plan.reference_bundles)}
        engine = {}
        if any(i in span for span in plan.engine_bundles):
            engine = engine_memory(shape, cfg, len(plan.engine_bundles), engine_tp)
        rows.append(GpuRow(i, " + ".join(roles), train, engine))
    lines.extend(format_table(rows, section.gpu_memory_gib))
    if any(row.peak > section.gpu_memory_gib * GIB for row in rows):
        lines.append("warning: some GPUs exceed their memory in this estimate; lower "
                     "trainer.torch.max_tokens_per_micro_batch, add GPUs or raise tp")
    return "\n".join(lines)


def _shape_line(cfg: TrainConfig, shape: ModelShape | None) -> str:
    if shape is None:
        return (f"model shape: unknown ({cfg.model.path} has no config.json yet; set "
                f"placement.model_shape to one of {', '.join(NAMED_SHAPES)} for an estimate)")
    return (f"model shape: {shape.params / 1e9:.2f}B params, {shape.layers} layers, "
            f"hidden {shape.hidden}, {shape.kv_heads} kv heads x {shape.head_dim} "
            f"[{shape.source}]")


def describe_placement(cfg: TrainConfig, environ: Mapping[str, str] | None = None) -> str:
    """The placement plan and per-GPU memory table, or the single-process layout."""
    environ = os.environ if environ is None else environ
    if getattr(cfg, "placement", None) is not None:
        return describe_section(cfg, environ)
    shape = resolve_shape(cfg, environ)
    lines = []
    if shape is None:
        lines.append(f"model shape: unknown ({cfg.model.path} has no config.json yet; set "
                     f"PALAESTRA_MODEL_SHAPE to one of {', '.join(NAMED_SHAPES)} for an estimate)")
    else:
        lines.append(f"model shape: {shape.params / 1e9:.2f}B params, {shape.layers} layers, "
                     f"hidden {shape.hidden}, {shape.kv_heads} kv heads x {shape.head_dim} "
                     f"[{shape.source}]")
    fields = placement_fields(cfg, environ)
    if fields is None:
        device = cfg.engine.device or cfg.trainer.torch.device
        lines.append(f"placement: single process on {device} (embedded engine; set "
                     "PALAESTRA_GPUS/PALAESTRA_COLOCATE for a GPU placement)")
        return "\n".join(lines)
    megatron = getattr(cfg.trainer, "megatron", None)
    model_parallel = megatron.tp * megatron.pp if megatron and cfg.trainer.backend == "megatron" else 1
    trainer_tp = _int_env(environ, "PALAESTRA_TRAINER_TP", model_parallel) or 1
    placement, rows = plan_rows(cfg, fields, shape, trainer_tp)
    lines.append(placement + (f"; trainer tp {trainer_tp}" if trainer_tp > 1 else ""))
    gpu_gib = float(environ.get("PALAESTRA_GPU_MEMORY_GIB") or 139)
    if shape is not None:
        lines.extend(format_table(rows, gpu_gib))
        if any(row.peak > gpu_gib * GIB for row in rows):
            lines.append("warning: some GPUs exceed their memory in this estimate; lower "
                         "trainer.torch.max_tokens_per_micro_batch, add GPUs or raise tp")
    else:
        lines.extend(f"{row.index:>3}  {row.roles}" for row in rows)
    return "\n".join(lines)


def _tasks_line(cfg: TrainConfig) -> str:
    """Where training and held-out tasks come from, and how many of each."""
    d, e = cfg.data, cfg.eval
    if d.path is None:
        return (f"tasks: {d.num_tasks} drawn from {cfg.env.id} (data.seed {d.seed}); held out: "
                f"{e.num_tasks} drawn from the env with eval.seed {e.seed} (training draws that "
                "repeat one are dropped)")
    from palaestra.rollout.task_checks import scan_rows

    rows = scan_rows(d.path, lambda row: []).num_rows
    return (f"tasks: {d.path} has {rows} rows: the first {rows - e.num_tasks} train, the last "
            f"{e.num_tasks} are held out (eval.num_tasks) and never trained on")


def describe_plan(cfg: TrainConfig, environ: Mapping[str, str] | None = None) -> str:
    """A human-readable summary: what runs where, with the per-GPU memory estimate."""
    lines = [f"run directory: {cfg.out}",
             f"algorithm: {cfg.algorithm} (backend {cfg.trainer.backend})"]
    built = f" (built locally: {cfg.model.init_size})" if cfg.model.init_size else ""
    lines.append(f"model: {cfg.model.path.replace('{out}', cfg.out)}{built}")
    if cfg.algorithm == "rl":
        r = cfg.rollout
        lines.append(f"env: {cfg.env.id}; loss preset: {cfg.trainer.loss.preset}")
        lines.append(
            f"rollout: {r.batch_size} prompts x {r.group_size} samples per step, {r.mode} mode, "
            f"{r.num_workers} workers ({r.cluster}"
            + (f" at {r.ray_address}" if r.ray_address else "")
            + f"), max {r.max_new_tokens} new tokens/turn"
        )
        lines.append(f"engine: {_engine_line(cfg)}; weight sync: {_sync_line(cfg)}")
        lines.append(_tasks_line(cfg))
        if cfg.warmup.steps:
            lines.append(f"warm start: {cfg.warmup.steps} SFT steps on {cfg.warmup.demonstrations}")
        from palaestra.run.phases.critic import critic_plan_line

        lines.append(critic_plan_line(cfg))
    from palaestra.run.config_checks import launch_problems

    lines += [f"warning: {p.message} (a run on this machine would stop here)"
              for p in launch_problems(cfg)]
    lines.append(describe_placement(cfg, environ))
    lines.append("resolved config:")
    lines.append(json.dumps(cfg.model_dump(), indent=2))
    return "\n".join(lines)

"""GPU memory of a run's plan (``--dry-run``): the model's shape (`resolve_shape`: its
config.json, a named shape, or ``PALAESTRA_MODEL_SHAPE``), the placement the environment
describes, and the memory each GPU's trainer and engine would hold (`plan_rows`,
`format_table`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from palaestra.errors import ConfigError
from palaestra.model_shapes import NAMED_SHAPES
from palaestra.run.config import TrainConfig

GIB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    """What the memory estimate needs of a model."""

    name: str
    source: str  # where the shape came from
    params: int
    hidden: int
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int


@dataclass(frozen=True)
class GpuRow:
    """One GPU of the plan: its roles and the estimated peak memory (bytes) of each part."""

    index: int
    roles: str
    train: dict[str, float]
    engine: dict[str, float]

    @property
    def peak(self) -> float:
        return max(sum(self.train.values()), sum(self.engine.values()))


def resolve_shape(cfg: TrainConfig, environ: Mapping[str, str]) -> ModelShape | None:
    """The model's shape: ``model.path``/config.json, else a named shape, else None (unknown)."""
    from palaestra.trainers.megatron.arch import arch_from_hf_config
    from palaestra.trainers.megatron.flops import param_count

    path = cfg.in_run(cfg.model.path)
    hf: dict[str, Any] | None = None
    source = ""
    if (path / "config.json").is_file():
        hf, source = json.loads((path / "config.json").read_text()), f"{path}/config.json"
    else:
        wanted = environ.get("PALAESTRA_MODEL_SHAPE")
        if wanted:
            if wanted.lower() not in NAMED_SHAPES:
                raise ConfigError(
                    f"PALAESTRA_MODEL_SHAPE={wanted!r} is not a known shape; use one of "
                    f"{', '.join(sorted(NAMED_SHAPES))} or point model.path at a checkpoint"
                )
            hf, source = NAMED_SHAPES[wanted.lower()], "PALAESTRA_MODEL_SHAPE"
        else:
            name = path.name.lower()
            # longest first, so "qwen2.5-1.5b" wins over a shorter prefix
            for key in sorted(NAMED_SHAPES, key=len, reverse=True):
                if name.startswith(key) and not name[len(key):len(key) + 1].isdigit():
                    hf, source = NAMED_SHAPES[key], f"named shape {key!r} (from model.path)"
                    break
    if hf is None:
        return None
    arch = arch_from_hf_config(hf)
    return ModelShape(
        name=str(hf.get("_name_or_path") or path.name), source=source,
        params=param_count(arch).total, hidden=arch.hidden_size, layers=arch.num_layers,
        kv_heads=arch.num_kv_heads, head_dim=arch.head_dim, vocab=arch.vocab_size,
    )


def _int_env(environ: Mapping[str, str], key: str, default: int | None) -> int | None:
    text = environ.get(key)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{key}={text!r} must be an integer") from None


def placement_fields(cfg: TrainConfig, environ: Mapping[str, str]) -> dict[str, Any] | None:
    """`PlacementConfig` fields from the config's ``placement`` section or the environment;
    None when the run is a single process (no GPU placement)."""
    section = getattr(cfg, "placement", None)
    if section is not None:
        return section.model_dump() if hasattr(section, "model_dump") else dict(section)
    keys = ("PALAESTRA_GPUS", "PALAESTRA_TRAINER_GPUS", "PALAESTRA_ENGINE_GPUS",
            "PALAESTRA_COLOCATE")
    if not any(environ.get(k) for k in keys) and cfg.engine.kind == "local":
        return None
    tp = _int_env(environ, "PALAESTRA_ENGINE_TP", cfg.engine.launch_tp) or 1
    colocate = environ.get("PALAESTRA_COLOCATE", "0").lower() in ("1", "true", "yes")
    total = _int_env(environ, "PALAESTRA_GPUS", None)
    trainer = _int_env(environ, "PALAESTRA_TRAINER_GPUS", None)
    engine = _int_env(environ, "PALAESTRA_ENGINE_GPUS", None)
    if engine is None:
        if cfg.engine.kind == "sglang" and not colocate:
            engine = len(cfg.engine.urls) * tp + len(cfg.engine.launch_gpus)
            if cfg.engine.launch != "none" and not cfg.engine.launch_gpus:
                return None  # one launched CPU server beside the trainer: no GPU placement
        elif colocate:
            engine = trainer or total or 1
        elif total is not None and trainer is not None:
            engine = total - trainer
        else:
            engine = tp
    if trainer is None:
        trainer = engine if colocate else (total - engine if total is not None else 1)
    return {"trainer_gpus": trainer, "engine_gpus": engine, "engine_tp": tp,
            "colocate": colocate, "gpus_per_node": _int_env(environ, "PALAESTRA_GPUS_PER_NODE", 8),
            "num_gpus": total}


def train_memory(shape: ModelShape, cfg: TrainConfig, gpus: int, tp: int) -> dict[str, float]:
    """Bytes on one trainer GPU (see the module docstring for the model)."""
    p = shape.params
    megatron = getattr(cfg.trainer, "megatron", None) if cfg.trainer.backend == "megatron" else None
    if megatron is not None:
        tokens, recompute = megatron.max_tokens_per_micro_batch, megatron.recompute
    else:
        tokens = cfg.trainer.torch.max_tokens_per_micro_batch
        recompute = cfg.trainer.torch.gradient_checkpointing
    per_layer = 34 * tokens * shape.hidden / tp
    if recompute:  # layer inputs kept, one layer recomputed
        activations = 2 * tokens * shape.hidden * shape.layers + per_layer
    else:
        activations = per_layer * shape.layers
    from palaestra.run.phases.critic import uses_critic

    copies = 2 if uses_critic(cfg) else 1  # a critic of the policy's size, on the same GPUs
    mem = {
        "weights": copies * 2 * p / tp,
        "grads": copies * 4 * p / tp,
        "optimizer": copies * 12 * p / gpus,
        "activations": activations + 4 * tokens * shape.vocab / tp,
    }
    if cfg.trainer.torch.ref_model:
        mem["weights"] += 2 * p / tp
    return mem


def engine_memory(shape: ModelShape, cfg: TrainConfig, engines: int, tp: int) -> dict[str, float]:
    """Bytes on one engine GPU: its weight shard and its share of the KV cache of a step."""
    r = cfg.rollout
    in_flight = min(r.max_concurrency, r.batch_size * r.group_size)
    per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * 2  # K and V, bf16
    kv = in_flight * cfg.agent.max_context * per_token / max(engines, 1) / tp
    return {"weights": 2 * shape.params / tp, "kv_cache": kv}


def plan_rows(cfg: TrainConfig, fields: Mapping[str, Any], shape: ModelShape | None,
              trainer_tp: int) -> tuple[str, list[GpuRow]]:
    """The placement line (`plan_placement`) and one row per GPU."""
    from palaestra.run.fleet.placement import PlacementConfig, plan_placement

    known = set(PlacementConfig.__dataclass_fields__)
    plan = plan_placement(PlacementConfig(**{k: v for k, v in fields.items() if k in known}))
    trainer_gpus = len(plan.trainer_bundles)
    if trainer_gpus % trainer_tp:
        raise ConfigError(
            f"trainer GPUs ({trainer_gpus}) must be a multiple of the trainer's model parallelism "
            f"({trainer_tp}: trainer.megatron.tp x pp, or PALAESTRA_TRAINER_TP)"
        )
    engine_of = {b: e for e, span in enumerate(plan.engine_bundles) for b in span}
    engine_tp = len(plan.engine_bundles[0]) if plan.engine_bundles else 1
    rows = []
    for gpu in range(plan.num_gpus):
        roles = []
        train: dict[str, float] = {}
        engine: dict[str, float] = {}
        if gpu in plan.trainer_bundles:
            roles.append(f"trainer rank {gpu}")
            if shape:
                train = train_memory(shape, cfg, trainer_gpus, trainer_tp)
        if gpu in engine_of:
            roles.append(f"engine {engine_of[gpu]}" + (f" (tp {engine_tp})" if engine_tp > 1 else ""))
            if shape:
                engine = engine_memory(shape, cfg, len(plan.engine_bundles), engine_tp)
        rows.append(GpuRow(gpu, " + ".join(roles), train, engine))
    return "placement: " + plan.describe(), rows


def format_table(rows: list[GpuRow], gpu_memory_gib: float) -> list[str]:
    """The per-GPU table in GiB, flagging GPUs whose estimate exceeds their memory."""
    cols = ("weights", "grads", "optimizer", "activations")
    head = (f"{'gpu':>3}  {'roles':<28} " + " ".join(f"{c[:7]:>7}" for c in cols)
            + f" {'eng.w':>7} {'kv':>7} {'peak':>7}")
    title = (f"per-GPU memory estimate (GiB; a GPU has {gpu_memory_gib:.0f} GiB; colocated GPUs "
             "hold the larger phase):")
    out = [title, head]
    capacity = gpu_memory_gib * GIB
    for row in rows:
        cells = [row.train.get(c, 0.0) / GIB for c in cols]
        cells += [row.engine.get("weights", 0.0) / GIB, row.engine.get("kv_cache", 0.0) / GIB,
                  row.peak / GIB]
        flag = "  OVER" if row.peak > capacity else ""
        out.append(f"{row.index:>3}  {row.roles:<28} " + " ".join(f"{c:7.1f}" for c in cells) + flag)
    return out


__all__ = ["GIB", "GpuRow", "ModelShape", "engine_memory", "format_table", "placement_fields", "plan_rows", "resolve_shape", "train_memory"]

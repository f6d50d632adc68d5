"""Offline training: SFT on chat transcripts (also the RL warm start) and DPO on preference pairs.

Transcripts become `Sample`s through `palaestra.agents.demonstrations` (loss mask 1 exactly on
the assistant turns, in the layout RL episodes have); batches are drawn in a seeded order that
depends only on the step, so a resumed run trains on the same batches as an uninterrupted one.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from palaestra.errors import ConfigError
from palaestra.progress import Bar, progress_bar
from palaestra.run.config import TrainConfig
from palaestra.run.run_dir import RunDir
from palaestra.types import Sample

if TYPE_CHECKING:
    from palaestra.agents.spec import AgentSpec
    from palaestra.trainers.torch_backend.config import TorchBackendConfig


def _load_jsonl(path: str) -> list[dict[str, Any]]:
    from palaestra.jsonl import read_jsonl

    if not Path(path).is_file():
        raise ConfigError(f"dataset {path!r} does not exist")
    return read_jsonl(path)


def _call_entry_point(target: str, n: int, seed: int, env_kwargs: dict[str, Any],
                      kwargs: dict[str, Any]) -> list[Any]:
    module_name, _, attr = target.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load demonstrations from {target!r}: {exc}") from None
    return list(fn(n, seed=seed, env_kwargs=env_kwargs, **kwargs))


def demonstration_samples(cfg: TrainConfig, spec: AgentSpec) -> list[Sample]:
    """The warm-start transcripts of ``cfg.warmup`` as samples (tools from the env's schema)."""
    source = str(cfg.warmup.demonstrations)
    if ":" in source and not Path(source).exists():
        dialogues = _call_entry_point(source, cfg.warmup.num_demonstrations, cfg.seed,
                                      dict(cfg.env.kwargs), dict(cfg.warmup.kwargs))
        rows = [{"messages": d} for d in dialogues]
    else:
        rows = _load_jsonl(source)
    tools = _env_tools(cfg) if cfg.agent.tools_in_prompt else []
    return transcripts_to_samples(rows, spec, tools)


def _env_tools(cfg: TrainConfig) -> list[dict[str, Any]]:
    """OpenAI function schemas of the run's env, built once with its kwargs ([] for a plain env):
    offline SFT puts the env's tools into the demonstrations' prompts."""
    from palaestra import envs

    env = envs.make(cfg.env.id, **dict(cfg.env.kwargs))
    try:
        return list(env.tool_schemas())
    finally:
        env.close()


def transcripts_to_samples(
    rows: list[dict[str, Any]], spec: AgentSpec,
    default_tools: list[dict[str, Any]] | None = None,
) -> list[Sample]:
    """``{"messages": [...], "tools": [...]}`` rows -> samples (assistant turns trained)."""
    from palaestra.agents.demonstrations import demonstration_to_sample

    agent = spec.build()
    out = []
    for i, row in enumerate(rows):
        if "messages" not in row:
            raise ConfigError(f"transcript {i} has no 'messages' list")
        tools = row.get("tools", default_tools or [])
        out.append(demonstration_to_sample(agent, row["messages"], tools, task_id=str(i)))
    return out


def _batch_indices(n: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Indices of step ``step``: seeded permutations per epoch, a function of the step only."""
    start = step * batch_size
    out: list[int] = []
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), n)
        perm = np.random.default_rng([seed, epoch]).permutation(n)
        take = min(batch_size - len(out), n - offset)
        out.extend(int(i) for i in perm[offset: offset + take])
    return out


def offline_backend(cfg: TrainConfig, model_path: Path, torch_cfg: TorchBackendConfig) -> Any:
    """The backend of an offline run (``algorithm = "sft"/"dpo"``): Megatron-core when
    ``trainer.backend = "megatron"`` (its own ``trainer.megatron`` settings, the phase's logits
    temperature, a reference policy for DPO), else PyTorch with ``torch_cfg``."""
    from palaestra.run.builders import megatron_backend

    if cfg.trainer.backend == "megatron" and cfg.algorithm != "rl":
        return megatron_backend(cfg.trainer.megatron, model_path, seed=cfg.seed,
                                steps=cfg.trainer.steps,
                                logits_temperature=torch_cfg.logits_temperature,
                                ref_model=cfg.algorithm == "dpo")
    from palaestra.trainers.torch_backend.backend import TorchBackend

    return TorchBackend(model_path, torch_cfg)


def sft_steps(
    cfg: TrainConfig,
    run: RunDir,
    model_path: Path,
    samples: list[Sample],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    phase: str,
    export_to: Path | None = None,
) -> Any:
    """SFT over ``samples`` for ``steps`` steps with checkpoints; resumes a killed phase."""
    from palaestra.run.builders import backend_config
    from palaestra.trainers.algorithms.config import LossConfig
    from palaestra.trainers.batching import TrainBatch

    if not samples:
        raise ConfigError("no SFT examples: the demonstrations/dataset are empty")
    schedule = cfg.warmup.lr_schedule if phase == "sft" and cfg.algorithm == "rl" else None
    # bitwise on-policy mode matters where an engine sampled what is trained, not here
    update: dict[str, Any] = {"logits_temperature": 1.0, "on_policy": "default"}
    if phase == "sft" and cfg.algorithm == "rl" and not cfg.warmup.lora:
        update["lora"] = None  # the warm start trains the full model; RL trains the adapter
    if schedule is not None:
        update.update(lr_schedule=schedule, total_steps=steps, min_lr_ratio=0.1,
                      warmup_steps=min(cfg.warmup.lr_warmup_steps, steps))
    torch_cfg = backend_config(cfg.trainer.torch, temperature=cfg.rollout.temperature,
                               seed=cfg.seed, lr=lr, steps=steps).model_copy(update=update)
    # the RL warm start always runs on the PyTorch backend; `algorithm = "sft"` follows
    # trainer.backend
    backend = offline_backend(cfg, model_path, torch_cfg)
    loss_cfg = LossConfig(preset="sft")
    start = 0
    latest = run.latest_checkpoint(phase) if cfg.checkpoint.resume else None
    if latest is not None:
        start = int(backend.load(latest)["phase_step"])
        run.truncate_metrics_after(phase, start - 1)
        print(f"resumed {phase} from {latest.name} (step {start})", flush=True)
    bar = _bar(cfg, steps, start, phase)
    for step in range(start, steps):
        idx = _batch_indices(len(samples), batch_size, step, cfg.seed)
        batch = TrainBatch.from_samples([samples[i] for i in idx])
        metrics = backend.train_step(batch, loss_cfg)
        run.log_metrics({"step": step, "global_step": step, "phase": phase, "reward_mean": None,
                         "loss": metrics["loss"], **{f"train/{k}": v for k, v in metrics.items()}})
        if bar is not None:
            bar.set_postfix(loss=f"{metrics['loss']:.3f}")
            bar.update(1)
        if (step + 1) % cfg.checkpoint.interval == 0 or step + 1 == steps:
            directory = run.checkpoint_dir(phase, step + 1)
            backend.save(directory, extra={"phase_step": step + 1})
            run.mark_complete(directory)
            run.write_state({"phase": phase, "step": step + 1})
            run.prune_checkpoints(phase, cfg.checkpoint.keep_last)
    if bar is not None:
        bar.close()
    if export_to is not None:
        backend.export_hf(export_to)
    return backend


def _bar(cfg: TrainConfig, total: int, start: int, phase: str) -> Bar | None:
    if not cfg.logging.progress:
        return None
    return progress_bar(total, initial=start, desc=phase, unit="step")


def dpo_steps(cfg: TrainConfig, run: RunDir, model_path: Path, spec: AgentSpec) -> Any:
    """DPO on ``{"prompt", "chosen", "rejected"}`` rows; reference = frozen initial policy."""
    from palaestra.run.builders import backend_config
    from palaestra.trainers.algorithms.config import LossConfig
    from palaestra.trainers.batching import TrainBatch

    rows = _load_jsonl(str(cfg.offline.dataset))
    chosen, rejected = [], []
    for i, row in enumerate(rows):
        missing = {"prompt", "chosen", "rejected"} - set(row)
        if missing:
            raise ConfigError(f"DPO row {i} lacks {sorted(missing)}")
        tools = row.get("tools", [])
        chosen += transcripts_to_samples([{"messages": row["prompt"] + row["chosen"], "tools": tools}], spec)
        rejected += transcripts_to_samples([{"messages": row["prompt"] + row["rejected"], "tools": tools}], spec)
    steps = cfg.trainer.steps
    torch_cfg = backend_config(cfg.trainer.torch, temperature=cfg.rollout.temperature,
                               seed=cfg.seed, steps=steps).model_copy(
        update={"logits_temperature": 1.0, "ref_model": True, "on_policy": "default"})
    backend = offline_backend(cfg, model_path, torch_cfg)
    loss_cfg = cfg.trainer.loss if cfg.trainer.loss.objective == "dpo" else LossConfig(preset="dpo")
    start = 0
    latest = run.latest_checkpoint("dpo") if cfg.checkpoint.resume else None
    if latest is not None:
        start = int(backend.load(latest)["phase_step"])
    for step in range(start, steps):
        idx = _batch_indices(len(chosen), cfg.offline.batch_size, step, cfg.seed)
        batch = TrainBatch.from_pairs([chosen[i] for i in idx], [rejected[i] for i in idx])
        batch = batch.replace(ref_logprobs=backend.forward_logprobs(batch, ref=True))
        metrics = backend.train_step(batch, loss_cfg)
        run.log_metrics({"step": step, "global_step": step, "phase": "dpo", "reward_mean": None,
                         "loss": metrics["loss"], **{f"train/{k}": v for k, v in metrics.items()}})
        if (step + 1) % cfg.checkpoint.interval == 0 or step + 1 == steps:
            directory = run.checkpoint_dir("dpo", step + 1)
            backend.save(directory, extra={"phase_step": step + 1})
            run.mark_complete(directory)
            run.prune_checkpoints("dpo", cfg.checkpoint.keep_last)
    backend.export_hf(run.root / "final-model")
    return backend


def run_offline(cfg: TrainConfig, run: RunDir, model_path: Path, spec: AgentSpec) -> None:
    """``algorithm = "sft"`` or ``"dpo"`` on ``offline.dataset``; exports ``final-model``."""
    if cfg.algorithm == "dpo":
        dpo_steps(cfg, run, model_path, spec)
        return
    rows = _load_jsonl(str(cfg.offline.dataset))
    samples = transcripts_to_samples(rows, spec)
    sft_steps(cfg, run, model_path, samples, steps=cfg.trainer.steps,
              batch_size=cfg.offline.batch_size, lr=cfg.trainer.torch.lr, phase="sft",
              export_to=run.root / "final-model")

"""``palaestra train``: the RL loop (sync or async), its SFT warm start, evaluation and resume.

One run, in phases recorded in ``state.json`` so that a killed run resumes where it stopped::

    init eval -> [warm-up SFT on demonstrations -> sft eval] -> RL steps -> rl eval -> curves

RL step (sync): rollout batch (engines at policy version v) -> advantages -> train step(s) ->
weights to the engines (version v+1) -> metrics -> checkpoint. Async: the manager generates batch
k+1 while step k trains (in a worker thread, so the engine keeps serving), bounded by
``rollout.max_staleness``. The embedded engine lives in this process: ``cluster = "local"`` hands
it to in-process workers; ``cluster = "ray"`` serves it over loopback HTTP (SGLang's native API)
to Ray workers. ``engine.kind = "sglang"`` attaches to SGLang servers instead; `EngineSync` moves
the weights after every step (in process, NCCL/gloo broadcast, disk or HTTP tensors).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from palaestra.config import save_resolved
from palaestra.trainers.config import TrainConfig
from palaestra.trainers.engine_sync import EngineSync
from palaestra.trainers.run_dir import RunDir, plot_curves


def ensure_model(cfg: TrainConfig) -> Path:
    """The policy checkpoint; built locally (``palaestra init-model``) when asked and missing."""
    path = Path(cfg.model.path.replace("{out}", cfg.out))
    if (path / "config.json").exists():
        return path
    if cfg.model.init_size is None:
        from palaestra.errors import ConfigError

        raise ConfigError(
            f"no model at {str(path)!r}: point model.path at a Hugging Face checkpoint, or set "
            "model.init_size (e.g. \"tiny\") to build a local one there"
        )
    from palaestra.tiny_model import build_model

    return build_model(path, cfg.model.init_size, seed=cfg.model.init_seed)


def agent_spec(cfg: TrainConfig, tokenizer_path: Path) -> Any:
    from palaestra.agents import AgentSpec

    return AgentSpec(
        str(tokenizer_path),
        family=cfg.agent.family,
        max_context=cfg.agent.max_context,
        drift_rate=cfg.agent.drift_rate,
        strict_drift=cfg.agent.strict_drift,
        tools_in_prompt=cfg.agent.tools_in_prompt,
    )


def sampling_params(cfg: TrainConfig, temperature: float | None = None) -> Any:
    from palaestra.rollout.engines.base import SamplingParams

    return SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature if temperature is None else temperature,
        top_p=cfg.rollout.top_p,
    )


def build_engine(cfg: TrainConfig, model_path: Path) -> Any:
    """The embedded engine, or a client over SGLang servers (``engine.urls`` and the ones
    ``engine.launch`` starts, logging to ``<out>/servers``)."""
    if cfg.engine.kind == "sglang":
        from palaestra.trainers.server_launch import launched_engine

        return launched_engine(cfg.engine, model_path, Path(cfg.out) / "servers")
    from palaestra.rollout.engines import LocalEngine

    return LocalEngine(
        model_path,
        device=cfg.engine.device,
        max_running=cfg.engine.max_running,
        max_model_len=cfg.agent.max_context,
        seed=cfg.seed,
        # async mode trains in a thread while this engine decodes on the same device: captured
        # CUDA graphs replayed beside the training kernels failed on the H200 run
        cuda_graphs=cfg.rollout.mode != "async",
    )


async def evaluate_stage(
    cfg: TrainConfig, run: RunDir, engine: Any, spec: Any, stage: str, step: int | None = None
) -> dict[str, float]:
    """Success rate on the fixed held-out tasks; logged to eval.jsonl under ``stage``."""
    from palaestra.rollout.tasks import evaluate_tasks, tasks_from_env

    rows = tasks_from_env(
        cfg.env.id, cfg.eval.num_tasks, seed=cfg.eval.seed, env_kwargs=cfg.env.kwargs
    ) if cfg.data.path is None else _eval_rows_from_file(cfg)
    start = time.perf_counter()
    metrics, _ = await evaluate_tasks(
        engine, spec, cfg.env.id, rows, sampling_params(cfg, cfg.eval.temperature),
        env_kwargs=cfg.env.kwargs, seed=cfg.eval.seed,
    )
    record = {"stage": stage, **metrics, "time_s": round(time.perf_counter() - start, 2)}
    if step is not None:
        record["step"] = step
    run.log_eval(record)
    print(f"[eval {stage}] success rate {metrics['success_rate']:.3f} on {int(metrics['tasks'])} "
          f"held-out tasks ({record['time_s']} s)", flush=True)
    return metrics


def _eval_rows_from_file(cfg: TrainConfig) -> list[dict[str, Any]]:
    from palaestra.rollout.data import load_rows

    rows = load_rows(str(cfg.data.path))
    return rows[-cfg.eval.num_tasks:]  # the tail of the file is held out from training draws


def _train_rows(cfg: TrainConfig) -> list[dict[str, Any]]:
    from palaestra.rollout.data import load_rows
    from palaestra.rollout.tasks import tasks_from_env

    if cfg.data.path is None:
        return tasks_from_env(
            cfg.env.id, cfg.data.num_tasks, seed=cfg.data.seed, env_kwargs=cfg.env.kwargs
        )
    rows = load_rows(str(cfg.data.path))
    return rows[: len(rows) - cfg.eval.num_tasks] if len(rows) > 2 * cfg.eval.num_tasks else rows


def megatron_backend(cfg: TrainConfig, model_path: Path, **changes: Any) -> Any:
    """A Megatron-core backend on ``model_path`` from ``trainer.megatron`` (seeded, its schedule
    over ``trainer.steps``), with ``changes`` to those settings."""
    from transformers import AutoConfig

    from palaestra.trainers.megatron import MegatronBackend

    changes = {"seed": cfg.seed, **changes}
    if cfg.trainer.megatron.lr_schedule != "constant":
        changes["total_steps"] = cfg.trainer.steps
    return MegatronBackend(AutoConfig.from_pretrained(model_path),
                           cfg.trainer.megatron.model_copy(update=changes), model_path=model_path)


def build_backend(cfg: TrainConfig, policy_path: Path) -> Any:
    """The RL training backend: the PyTorch one, or Megatron-core on CUDA machines."""
    if cfg.trainer.backend == "megatron":
        return megatron_backend(cfg, policy_path, logits_temperature=cfg.rollout.temperature)
    from palaestra.trainers.torch_backend import TorchBackend

    return TorchBackend(policy_path, backend_config(cfg, steps=cfg.trainer.steps))


def backend_config(cfg: TrainConfig, *, lr: float | None = None, steps: int | None = None) -> Any:
    """The torch backend settings of a phase (logits scaled by the sampling temperature)."""
    changes: dict[str, Any] = {"logits_temperature": cfg.rollout.temperature, "seed": cfg.seed}
    if lr is not None:
        changes["lr"] = lr
    torch_cfg = cfg.trainer.torch
    if steps is not None and torch_cfg.lr_schedule != "constant":
        changes["total_steps"] = steps
    return torch_cfg.model_copy(update=changes)


# ----------------------------------------------------------------------------------- phases
async def run_warmup(cfg: TrainConfig, run: RunDir, model_path: Path, spec: Any) -> Path:
    """SFT on demonstrations; returns the exported warm-started model (resumable)."""
    from palaestra.trainers.offline import demonstration_samples, sft_steps

    out = run.root / "sft-model"
    if (out / "config.json").exists() and run.read_state().get("phase") not in (None, "sft"):
        return out
    samples = demonstration_samples(cfg, spec)
    await asyncio.to_thread(
        sft_steps, cfg, run, model_path, samples, steps=cfg.warmup.steps,
        batch_size=cfg.warmup.batch_size, lr=cfg.warmup.lr, phase="sft", export_to=out,
    )
    run.write_state({"phase": "rl", "step": 0})
    return out


async def run_rl(cfg: TrainConfig, run: RunDir, policy_path: Path, spec: Any, engine: Any,
                 sync: EngineSync) -> None:
    """The RL steps, resumable from the newest ``rl-*`` checkpoint."""
    from palaestra.rollout import DataSource, EngineSpec, RolloutManager, WorkerConfig
    from palaestra.rollout.config import RolloutConfig
    from palaestra.trainers.algorithms import compute_advantages
    from palaestra.trainers.batching import TrainBatch

    r = cfg.rollout
    backend = build_backend(cfg, policy_path)
    data = DataSource(_train_rows(cfg), env_id=cfg.env.id, shuffle=cfg.data.shuffle,
                      seed=cfg.data.seed, epochs=cfg.data.epochs)
    server = None
    if r.cluster == "ray" and cfg.engine.kind == "sglang":
        engine_spec, live_engine = EngineSpec.http([c.url for c in engine.clients]), None
    elif r.cluster == "ray":
        from palaestra.rollout.engines.serve import start_server

        server = await start_server(engine, port=0)
        engine_spec = EngineSpec.http([server.url])
        live_engine = None
    else:
        engine_spec, live_engine = EngineSpec(), engine
    worker_cfg = WorkerConfig(
        engine=engine_spec, agent=spec, sampling=sampling_params(cfg),
        env_kwargs={cfg.env.id: dict(cfg.env.kwargs)}, max_turns=r.max_turns,
    )
    rollout_cfg = RolloutConfig(
        batch_size=r.batch_size, group_size=r.group_size, max_concurrency=r.max_concurrency,
        over_sampling=r.over_sampling, filters=tuple(r.filters), mode=r.mode,
        max_staleness=r.max_staleness, max_failure_rate=r.max_failure_rate,
        num_workers=r.num_workers,
    )
    manager = RolloutManager(data, worker_cfg, rollout_cfg, cluster=r.cluster,
                             address=r.ray_address, engine=live_engine)
    start_step = 0
    latest = run.latest_checkpoint("rl") if cfg.checkpoint.resume else None
    if latest is not None:
        state = backend.load(latest)  # the saved extras sit beside the backend's own keys
        start_step = int(state["rl_step"])
        manager.load_state_dict(state["rollout"])
        await sync.push_now(backend, start_step)
        run.truncate_metrics_after("rl", start_step - 1)
        print(f"resumed RL from {latest.name} (step {start_step})", flush=True)
    elif engine.weight_version != 0 or cfg.engine.kind == "sglang":
        await sync.push_now(backend, 0)  # servers may hold anything: start them at the policy
    progress = _progress(cfg, start_step)
    evaluator = None
    if cfg.benchmark_eval.benchmarks:
        from palaestra.agents import load_tokenizer
        from palaestra.benchmarks.training import TrainingEvaluator

        evaluator = TrainingEvaluator(cfg.benchmark_eval, tokenizer=load_tokenizer(policy_path),
                                      family=cfg.agent.family, run_dir=run.root)
    try:
        async with manager:
            for step in range(start_step, cfg.trainer.steps):
                t0 = time.perf_counter()
                batch = await manager.generate_batch(step)
                t1 = time.perf_counter()
                train_batch = compute_advantages(TrainBatch.from_samples(batch.samples),
                                                 cfg.trainer.loss)
                train_metrics: dict[str, float] = {}
                for _ in range(cfg.trainer.updates_per_batch):
                    train_metrics = await asyncio.to_thread(
                        backend.train_step, train_batch, cfg.trainer.loss
                    )
                t2 = time.perf_counter()
                sync_times = await manager.update_weights(
                    push=sync.push(backend, step + 1), version=step + 1
                )
                t3 = time.perf_counter()
                record = _step_record(step, batch.metrics, train_metrics, sync_times,
                                      rollout_s=t1 - t0, train_s=t2 - t1, sync_s=t3 - t2,
                                      warmup_steps=cfg.warmup.steps)
                record.update(sync.metrics())
                if evaluator is not None and evaluator.due(step + 1):
                    record.update(await evaluator.evaluate(engine, step + 1))
                run.log_metrics(record)
                progress.update(record)
                if cfg.eval.interval and (step + 1) % cfg.eval.interval == 0 \
                        and step + 1 < cfg.trainer.steps:
                    await evaluate_stage(cfg, run, engine, spec, f"step-{step + 1}", step + 1)
                if (step + 1) % cfg.checkpoint.interval == 0 or step + 1 == cfg.trainer.steps:
                    _save_rl(cfg, run, backend, manager, step + 1)
        # the trained policy as a Hugging Face folder (tokenizer included): `palaestra eval
        # --model <out>/final-model`, SGLang or transformers load it as it is
        backend.export_hf(run.root / "final-model")
    finally:
        progress.close()
        if server is not None:
            await server.close()


def _save_rl(cfg: TrainConfig, run: RunDir, backend: Any, manager: Any, step: int) -> None:
    directory = run.checkpoint_dir("rl", step)
    backend.save(directory, extra={"rl_step": step, "rollout": manager.state_dict()})
    run.mark_complete(directory)
    run.write_state({"phase": "rl", "step": step})
    run.prune_checkpoints("rl", cfg.checkpoint.keep_last)


def _step_record(
    step: int, rollout: dict[str, float], train: dict[str, float], sync: dict[str, float],
    *, rollout_s: float, train_s: float, sync_s: float, warmup_steps: int,
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "step": step, "global_step": warmup_steps + step, "phase": "rl",
        "reward_mean": rollout.get("reward/mean", rollout.get("reward_mean")),
    }
    record.update({k: v for k, v in rollout.items() if isinstance(v, (int, float))})
    record.update({f"train/{k}": v for k, v in train.items()})
    record["loss"] = train.get("loss")
    record["response_length_mean"] = rollout.get(
        "response_len/mean", rollout.get("response_length_mean"))
    total = rollout_s + train_s + sync_s
    record.update({
        "time/rollout_s": rollout_s, "time/train_s": train_s, "time/weight_sync_s": sync_s,
        "time/step_s": total, "time/weight_sync_share": sync_s / total if total else 0.0,
        **{f"time/sync_{k}": v for k, v in sync.items()},
    })
    return record


class _Progress:
    def __init__(self, bar: Any) -> None:
        self.bar = bar

    def update(self, record: dict[str, Any]) -> None:
        if self.bar is None:
            reward = record.get("reward_mean")
            print(f"[rl step {record['step']}] reward {reward:.3f} "
                  f"({record['time/step_s']:.1f} s)", flush=True)
            return
        self.bar.set_postfix(reward=f"{record.get('reward_mean') or 0:.3f}",
                             step_s=f"{record['time/step_s']:.1f}")
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _progress(cfg: TrainConfig, start: int) -> _Progress:
    if not cfg.logging.progress:
        return _Progress(None)
    from tqdm import tqdm

    return _Progress(tqdm(total=cfg.trainer.steps, initial=start, desc="rl", unit="step",
                          dynamic_ncols=True))


# ------------------------------------------------------------------------------------- main
async def train_async(cfg: TrainConfig) -> dict[str, Any]:
    """Run (or resume) the whole training run described by ``cfg``; returns the final evals."""
    import torch

    torch.manual_seed(cfg.seed)
    run = RunDir(cfg.out, tensorboard=cfg.logging.tensorboard)
    save_resolved(cfg, run.root)
    if not cfg.checkpoint.resume:
        run.write_state({})
    model_path = ensure_model(cfg)
    spec = agent_spec(cfg, model_path)
    try:
        if cfg.algorithm in ("sft", "dpo"):
            from palaestra.trainers.offline import run_offline

            await asyncio.to_thread(run_offline, cfg, run, model_path, spec)
            return {}
        engine = build_engine(cfg, model_path)
        sync: EngineSync | None = None
        try:
            if cfg.engine.kind == "sglang":
                await engine.start()
            sync = EngineSync.from_config(cfg, engine, model_path)
            if not run.has_eval("init"):
                await evaluate_stage(cfg, run, engine, spec, "init")
            policy_path = model_path
            if cfg.warmup.steps > 0:
                policy_path = await run_warmup(cfg, run, model_path, spec)
                await sync.push_checkpoint(policy_path, version=0)
                if not run.has_eval("sft"):
                    await evaluate_stage(cfg, run, engine, spec, "sft")
            if cfg.trainer.steps > 0 and run.read_state().get("phase") != "done":
                await run_rl(cfg, run, policy_path, spec, engine, sync)
                run.write_state({"phase": "done", "step": cfg.trainer.steps})
            if not run.has_eval("rl") and cfg.trainer.steps > 0:
                await evaluate_stage(cfg, run, engine, spec, "rl")
        finally:
            if sync is not None:
                await sync.close()
            await engine.close()
        return {e["stage"]: e["success_rate"] for e in run.read_jsonl("eval.jsonl")}
    finally:
        plot_curves(run)
        run.close()


def train(cfg: TrainConfig) -> dict[str, Any]:
    return asyncio.run(train_async(cfg))


__all__ = ["agent_spec", "ensure_model", "train", "train_async"]

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

Exact resume (sync mode): every request samples from its own seed (run seed, task draw, episode
index, request index), batches are in draw order and never drawn ahead (`RolloutManager`'s exact
batches), so a run killed at any step and resumed trains on the same samples as an uninterrupted
one. A resume refuses fixed settings that differ from the recorded ``config.json``
(`run_dir.check_resume`); a larger ``trainer.steps`` extends a finished run. Failed episodes go to
``failures.jsonl`` (with a console line per step), a step whose gradients are not finite is
counted in ``train/skipped_steps``, the console is copied to ``console.log``, and the end of a run
prints the time of each phase.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from palaestra.config import save_resolved
from palaestra.trainers.config import TrainConfig
from palaestra.trainers.engine_sync import EngineSync
from palaestra.trainers.run_dir import ConsoleLog, RunDir, check_resume, plot_curves
from palaestra.trainers.services import run_env_kwargs, run_services


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
        # async mode too: the engine captures its graphs thread-locally on its own stream, so
        # the training thread's kernels beside them neither fail nor serialise with decode
        cuda_graphs=True,
    )


async def evaluate_stage(
    cfg: TrainConfig, run: RunDir, engine: Any, spec: Any, stage: str, step: int | None = None
) -> dict[str, float]:
    """Success rate on the fixed held-out tasks; logged to eval.jsonl under ``stage``."""
    with _phases(_PHASE_OF_EVAL.get(stage, "evals")):
        return await _evaluate_stage(cfg, run, engine, spec, stage, step)


_PHASE_OF_EVAL = {"init": "init eval"}


async def _evaluate_stage(
    cfg: TrainConfig, run: RunDir, engine: Any, spec: Any, stage: str, step: int | None
) -> dict[str, float]:
    from palaestra.rollout.tasks import evaluate_tasks, tasks_from_env

    rows = tasks_from_env(
        cfg.env.id, cfg.eval.num_tasks, seed=cfg.eval.seed, env_kwargs=cfg.env.kwargs
    ) if cfg.data.path is None else _eval_rows_from_file(cfg)
    start = time.perf_counter()
    metrics, episodes = await evaluate_tasks(
        engine, spec, cfg.env.id, rows, sampling_params(cfg, cfg.eval.temperature),
        env_kwargs=run_env_kwargs(cfg), seed=cfg.eval.seed,
    )
    record = {"stage": stage, **metrics, "time_s": round(time.perf_counter() - start, 2)}
    if step is not None:
        record["step"] = step
    run.log_eval(record)
    failed = [t for t in episodes if t.failed]
    note = ""
    if failed:  # scored 0; say why, and keep the errors beside the training failures
        run.log_failures(f"eval/{stage}", step or 0, failed)
        common = Counter((t.error or t.stop_reason.value).splitlines()[0][:120] for t in failed)
        note = f"; {len(failed)} failed, e.g. {common.most_common(1)[0][0]} (failures.jsonl)"
    print(f"[eval {stage}] success rate {metrics['success_rate']:.3f} on {int(metrics['tasks'])} "
          f"held-out tasks ({record['time_s']} s){note}", flush=True)
    return metrics


def _eval_rows_from_file(cfg: TrainConfig) -> list[dict[str, Any]]:
    """The held-out rows: the last ``eval.num_tasks`` rows of ``data.path`` (never trained on)."""
    from palaestra.rollout.data import load_rows, split_held_out

    return split_held_out(load_rows(str(cfg.data.path)), cfg.eval.num_tasks)[1]


def _train_rows(cfg: TrainConfig) -> list[dict[str, Any]]:
    """Training tasks, never a held-out one: a file's rows before its held-out tail, or the
    env's draws less those equal to a held-out draw (envs with a finite dataset repeat tasks)."""
    from palaestra.rollout.data import load_rows, split_held_out, without_tasks
    from palaestra.rollout.tasks import tasks_from_env

    if cfg.data.path is None:
        rows = tasks_from_env(
            cfg.env.id, cfg.data.num_tasks, seed=cfg.data.seed, env_kwargs=cfg.env.kwargs
        )
        return without_tasks(rows, tasks_from_env(
            cfg.env.id, cfg.eval.num_tasks, seed=cfg.eval.seed, env_kwargs=cfg.env.kwargs))
    rows = load_rows(str(cfg.data.path))
    return split_held_out(rows, cfg.eval.num_tasks)[0]  # the held-out tail is never trained on


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
        env_kwargs={cfg.env.id: run_env_kwargs(cfg)}, max_turns=r.max_turns,
        seed_sampling=True,  # a seed per request: no sample depends on a shared RNG stream
    )
    rollout_cfg = RolloutConfig(
        batch_size=r.batch_size, group_size=r.group_size, max_concurrency=r.max_concurrency,
        over_sampling=r.over_sampling, filters=tuple(r.filters), mode=r.mode,
        max_staleness=r.max_staleness, max_failure_rate=r.max_failure_rate,
        num_workers=r.num_workers,
    )
    manager = RolloutManager(data, worker_cfg, rollout_cfg, cluster=r.cluster,
                             address=r.ray_address, engine=live_engine, seed=cfg.seed,
                             exact=r.mode == "sync")
    if r.mode == "sync" and r.over_sampling > 1:
        print(f"[rl] rollout.over_sampling = {r.over_sampling} draws nothing ahead in sync mode "
              "(exact batches: groups drawn ahead would finish by timing); it applies in async "
              "mode", flush=True)
    start_step = 0
    counts: Counter[str] = Counter()  # skipped optimizer steps, failed episodes (whole run)
    latest = run.latest_checkpoint("rl") if cfg.checkpoint.resume else None
    if latest is not None:
        state = backend.load(latest)  # the saved extras sit beside the backend's own keys
        start_step = int(state["rl_step"])
        counts.update(state.get("counts", {}))
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
                                      family=cfg.agent.family, max_context=cfg.agent.max_context,
                                      tools_in_prompt=cfg.agent.tools_in_prompt,
                                      run_dir=run.root)
    try:
        async with manager:
            for step in range(start_step, cfg.trainer.steps):
                t0 = time.perf_counter()
                batch = await manager.generate_batch(step)
                t1 = time.perf_counter()
                train_batch = compute_advantages(TrainBatch.from_samples(batch.samples),
                                                 cfg.trainer.loss)
                if batch.failed:
                    counts["failed_episodes"] += run.log_failures("rl", step, batch.failed)
                    progress.note(_failure_line(step, batch, run))
                train_metrics: dict[str, float] = {}
                for _ in range(cfg.trainer.updates_per_batch):
                    train_metrics = await asyncio.to_thread(
                        backend.train_step, train_batch, cfg.trainer.loss
                    )
                    if _update_skipped(train_metrics):
                        counts["skipped_steps"] += 1
                        progress.note(
                            f"[rl step {step}] the gradients are not finite (grad norm "
                            f"{train_metrics.get('grad_norm')}, loss {train_metrics.get('loss')}):"
                            f" the optimizer step was skipped ({counts['skipped_steps']} so far)"
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
                record["train/skipped_steps"] = counts["skipped_steps"]
                if evaluator is not None and evaluator.due(step + 1):
                    record.update(await evaluator.evaluate(engine, step + 1))
                run.log_metrics(record)
                progress.update(record)
                if cfg.eval.interval and (step + 1) % cfg.eval.interval == 0 \
                        and step + 1 < cfg.trainer.steps:
                    await evaluate_stage(cfg, run, engine, spec, f"step-{step + 1}", step + 1)
                if (step + 1) % cfg.checkpoint.interval == 0 or step + 1 == cfg.trainer.steps:
                    _save_rl(cfg, run, backend, manager, step + 1, counts)
        # the trained policy as a Hugging Face folder (tokenizer included): `palaestra eval
        # --model <out>/final-model`, SGLang or transformers load it as it is
        backend.export_hf(run.root / "final-model")
        from palaestra.benchmarks.trained_settings import record_trained_settings

        # `palaestra eval --model <out>/final-model` plays as the held-out evaluation did
        record_trained_settings(run.root / "final-model", spec,
                                sampling_params(cfg, cfg.eval.temperature),
                                env_id=cfg.env.id, env_kwargs=cfg.env.kwargs)
    finally:
        progress.close()
        if server is not None:
            await server.close()


def _update_skipped(metrics: dict[str, float]) -> bool:
    """Whether the backend skipped the optimizer step: non-finite gradient norm (torch) or
    ``update_ok == 0`` (Megatron's optimizer found inf/NaN)."""
    grad_norm = metrics.get("grad_norm")
    bad_norm = grad_norm is not None and not math.isfinite(float(grad_norm))
    return bad_norm or metrics.get("update_ok", 1.0) == 0.0


def _failure_line(step: int, batch: Any, run: RunDir) -> str:
    """``[rl step N] k of n episodes failed: 2 x <error>; ...`` (one console line)."""
    finished = int(batch.metrics.get("episodes/finished", 0))
    common = Counter((t.error or t.stop_reason.value).splitlines()[0][:120]
                     for t in batch.failed).most_common(2)
    reasons = "; ".join(f"{n} x {err}" for err, n in common)
    return (f"[rl step {step}] {len(batch.failed)} of {finished} episodes failed: {reasons} "
            f"(all in {run.root / 'failures.jsonl'})")


def _save_rl(cfg: TrainConfig, run: RunDir, backend: Any, manager: Any, step: int,
             counts: Counter[str]) -> None:
    directory = run.checkpoint_dir("rl", step)
    backend.save(directory, extra={"rl_step": step, "rollout": manager.state_dict(),
                                   "counts": dict(counts)})
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

    def note(self, line: str) -> None:
        """A line above the bar (or a plain line without one)."""
        if self.bar is None:
            print(line, flush=True)
        else:
            self.bar.write(line)

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


# ----------------------------------------------------------------------------------- timing
class _Phases:
    """Wall time per phase; a phase nested in another is not counted twice (step evaluations
    inside RL count as evals)."""

    def __init__(self) -> None:
        self.began = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self._stack: list[list[float]] = []  # [start, time of nested phases]

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        frame = [time.perf_counter(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            spent = time.perf_counter() - frame[0]
            self.seconds[name] = self.seconds.get(name, 0.0) + spent - frame[1]
            if self._stack:
                self._stack[-1][1] += spent

    def summary(self) -> dict[str, float]:
        total = time.perf_counter() - self.began
        out = {"total": total, **self.seconds}
        out["setup and other"] = max(0.0, total - sum(self.seconds.values()))
        return {k: round(v, 2) for k, v in out.items()}


_CURRENT_PHASES: ContextVar[_Phases | None] = ContextVar("palaestra_phases", default=None)


@contextmanager
def _phases(name: str) -> Iterator[None]:
    phases = _CURRENT_PHASES.get()
    if phases is None:
        yield
        return
    with phases.time(name):
        yield


def _report_time(run: RunDir, phases: _Phases) -> None:
    times = phases.summary()
    (run.root / "timing.json").write_text(json.dumps(times, indent=2))
    parts = ", ".join(f"{k} {_duration(v)}" for k, v in times.items() if k != "total" and v > 0)
    print(f"[done] total {_duration(times['total'])} ({parts})", flush=True)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, sec = divmod(round(seconds), 60)
    return f"{minutes} min {sec:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def _quiet_transformers() -> None:
    """Only our progress bars: transformers' "Loading weights" / "Writing model shards" bars
    (and huggingface_hub's) would interleave with them."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


# ------------------------------------------------------------------------------------- main
async def train_async(cfg: TrainConfig) -> dict[str, Any]:
    """Run (or resume) the whole training run described by ``cfg``; returns the final evals.

    Raises `ConfigError` (before touching the run directory) when it holds a run whose fixed
    settings differ from ``cfg``.
    """
    check_run_dir(cfg)
    run = RunDir(cfg.out, tensorboard=cfg.logging.tensorboard)
    phases = _Phases()
    token = _CURRENT_PHASES.set(phases)
    try:
        with ConsoleLog(run.root / "console.log"):
            async with run_services(cfg, run.root):  # [services]: e.g. a retrieval server
                result = await _train(cfg, run)
            _report_time(run, phases)
            return result
    finally:
        _CURRENT_PHASES.reset(token)


def check_run_dir(cfg: TrainConfig) -> None:
    """Raise `ConfigError` listing the fixed settings that differ from those of the run already
    in ``cfg.out`` (nothing to check for a new run or with ``checkpoint.resume = false``)."""
    if cfg.checkpoint.resume:
        check_resume(cfg.out, json.loads(cfg.model_dump_json()), normalize=_resolved)


def _resolved(recorded: dict[str, Any]) -> dict[str, Any]:
    """A recorded config.json as this version resolves it (new fields at their defaults)."""
    return json.loads(TrainConfig.model_validate(recorded).model_dump_json())  # type: ignore[no-any-return]


async def _train(cfg: TrainConfig, run: RunDir) -> dict[str, Any]:
    import torch

    _quiet_transformers()
    torch.manual_seed(cfg.seed)
    state = run.read_state() if cfg.checkpoint.resume else {}
    print(f"[palaestra train] {'resuming' if state.get('phase') else 'starting'} {run.root} at "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}", flush=True)
    save_resolved(cfg, run.root)
    if not cfg.checkpoint.resume:
        run.write_state({})
    model_path = ensure_model(cfg)
    spec = agent_spec(cfg, model_path)
    try:
        if cfg.algorithm in ("sft", "dpo"):
            from palaestra.trainers.offline import run_offline

            with _phases(cfg.algorithm):
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
                with _phases("sft"):
                    policy_path = await run_warmup(cfg, run, model_path, spec)
                    await sync.push_checkpoint(policy_path, version=0)
                if not run.has_eval("sft"):
                    await evaluate_stage(cfg, run, engine, spec, "sft")
            state = run.read_state()
            # a finished run given more steps goes on from its last checkpoint
            if cfg.trainer.steps > 0 and (state.get("phase") != "done"
                                          or int(state.get("step", 0)) < cfg.trainer.steps):
                with _phases("rl"):
                    await run_rl(cfg, run, policy_path, spec, engine, sync)
                run.write_state({"phase": "done", "step": cfg.trainer.steps})
            if cfg.trainer.steps > 0 and not run.has_eval("rl", step=cfg.trainer.steps):
                await evaluate_stage(cfg, run, engine, spec, "rl", cfg.trainer.steps)
        finally:
            if sync is not None:
                await sync.close()
            await engine.close()
        return {e["stage"]: e["success_rate"] for e in run.read_jsonl("eval.jsonl")}
    finally:
        with _phases("curves"):
            plot_curves(run)
        run.close()


def train(cfg: TrainConfig) -> dict[str, Any]:
    return asyncio.run(train_async(cfg))


__all__ = ["agent_spec", "check_run_dir", "ensure_model", "train", "train_async"]

"""``palaestra train``: a whole training run, its SFT warm start, evaluations and resume.

One run, in phases recorded in ``state.json`` so that a killed run resumes where it stopped::

    init eval -> [warm-up SFT on demonstrations -> sft eval] -> RL steps -> rl eval -> curves

The RL steps are `palaestra.run.rl.RLRun`'s. The embedded engine lives in this process:
``cluster = "local"`` hands it to in-process workers; ``cluster = "ray"`` serves it over loopback
HTTP (SGLang's native API) to Ray workers. ``engine.kind = "sglang"`` attaches to SGLang servers
instead; `EngineSync` holds the path of the weights to them (in process, NCCL/gloo broadcast,
disk or HTTP tensors). A resume refuses fixed settings that differ from the recorded
``config.json`` (`run_dir.check_resume`); a larger ``trainer.steps`` extends a finished run. The
console is copied to ``console.log``, and the end of a run prints the time of each phase
(`palaestra.run.clock`).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from palaestra.config import save_resolved
from palaestra.run.builders import agent_spec, build_engine
from palaestra.run.clock import Phases, installed, phase, report_time
from palaestra.run.config import TrainConfig
from palaestra.run.fleet.engine_sync import EngineSync
from palaestra.run.held_out import evaluate_stage
from palaestra.run.rl import run_rl
from palaestra.run.run_dir import ConsoleLog, RunDir, check_resume, plot_curves
from palaestra.run.services import run_services

if TYPE_CHECKING:
    from palaestra.agents.spec import AgentSpec


def ensure_model(cfg: TrainConfig) -> Path:
    """The policy checkpoint; built locally (``palaestra init-model``) when asked and missing."""
    path = cfg.in_run(cfg.model.path)
    if (path / "config.json").exists():
        return path
    if cfg.model.init_from is not None:
        from palaestra.model_import import import_model

        return import_model(cfg.model.init_from, path, dtype=cfg.model.init_dtype)
    if cfg.model.init_size is None:
        from palaestra.errors import ConfigError

        raise ConfigError(
            f"no model at {str(path)!r}: point model.path at a Hugging Face checkpoint, or set "
            "model.init_size (e.g. \"tiny\") or model.init_from to build or fetch one there"
        )
    from palaestra.tiny_model import build_model

    return build_model(path, cfg.model.init_size, seed=cfg.model.init_seed)


# ----------------------------------------------------------------------------------- phases
async def run_warmup(cfg: TrainConfig, run: RunDir, model_path: Path, spec: AgentSpec) -> Path:
    """SFT on demonstrations; returns the exported warm-started model (resumable)."""
    from palaestra.run.phases.offline import demonstration_samples, sft_steps

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


def _quiet_transformers() -> None:
    """Only our progress bars: transformers' "Loading weights" / "Writing model shards" bars
    (and huggingface_hub's) would interleave with them."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


# ------------------------------------------------------------------------------------- main
async def train_async(cfg: TrainConfig) -> dict[str, float]:
    """Run (or resume) the whole training run described by ``cfg``; returns the final evals.

    Raises `ConfigError` (before touching the run directory) when it holds a run whose fixed
    settings differ from ``cfg``.
    """
    check_run_dir(cfg)
    from palaestra.run.cluster_fit import check_cluster_fit

    check_cluster_fit(cfg)  # actors an existing Ray cluster cannot place: refused before work
    run = RunDir(cfg.out, tensorboard=cfg.logging.tensorboard)
    with installed(Phases()) as phases, ConsoleLog(run.root / "console.log"):
        async with run_services(cfg, run.root):  # [services]: e.g. a retrieval server
            result = await _train(cfg, run)
        report_time(run.root, phases)
        return result


def check_run_dir(cfg: TrainConfig) -> None:
    """Raise `ConfigError` listing the fixed settings that differ from those of the run already
    in ``cfg.out`` (nothing to check for a new run or with ``checkpoint.resume = false``)."""
    if cfg.checkpoint.resume:
        check_resume(cfg.out, json.loads(cfg.model_dump_json()), normalize=_resolved)


def _resolved(recorded: dict[str, object]) -> dict[str, object]:
    """A recorded config.json as this version resolves it (new fields at their defaults)."""
    return json.loads(TrainConfig.model_validate(recorded).model_dump_json())  # type: ignore[no-any-return]


async def _train(cfg: TrainConfig, run: RunDir) -> dict[str, float]:
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
    from palaestra.run.phases.distill import check_teacher, teacher_path

    if (teacher := teacher_path(cfg)) is not None:  # the student exists now: same vocabulary?
        check_teacher(teacher, model_path)
    spec = agent_spec(cfg.agent, model_path)
    try:
        if cfg.algorithm == "rm":
            from palaestra.run.phases.reward_model import train_reward_model

            with phase("rm"):
                await asyncio.to_thread(train_reward_model, cfg, run, model_path)
            return {}
        if cfg.algorithm in ("sft", "dpo"):
            from palaestra.run.phases.offline import run_offline

            with phase(cfg.algorithm):
                await asyncio.to_thread(run_offline, cfg, run, model_path, spec)
            return {}
        from palaestra.run.fleet.start import start_engine_actors
        from palaestra.run.on_policy import bitwise as bitwise_on_policy

        # [placement] engines as Ray actors on their bundles, else the engines of [engine]
        engine_cfg, engine = await start_engine_actors(cfg, model_path) or (
            cfg.engine, build_engine(cfg.engine, model_path, max_model_len=cfg.agent.max_context,
                                     seed=cfg.seed, servers_dir=Path(cfg.out) / "servers",
                                     bitwise=bitwise_on_policy(cfg)))
        sync: EngineSync | None = None
        try:
            from palaestra.engines.clients.sglang import SGLangEngine

            if isinstance(engine, SGLangEngine):  # engine.kind = "sglang": attach / launch
                await engine.start()
            # LoRA with SGLang servers: adapters over /load_lora_adapter when this process's
            # engine makes the requests (Ray workers' clients get the merged weights)
            sync = EngineSync.from_config(engine_cfg, engine, model_path, out=cfg.out,
                                          colocate=cfg.placement is not None
                                          and cfg.placement.colocate,
                                          lora_servers=cfg.rollout.cluster == "local")
            if not run.has_eval("init"):
                await evaluate_stage(cfg, run, engine, spec, "init")
            policy_path = model_path
            if cfg.warmup.steps > 0:
                with phase("sft"):
                    policy_path = await run_warmup(cfg, run, model_path, spec)
                    await sync.push_checkpoint(policy_path, version=0)
                if not run.has_eval("sft"):
                    await evaluate_stage(cfg, run, engine, spec, "sft")
            state = run.read_state()
            # a finished run given more steps goes on from its last checkpoint
            if cfg.trainer.steps > 0 and (state.get("phase") != "done"
                                          or int(state.get("step", 0)) < cfg.trainer.steps):
                with phase("rl"):
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
        with phase("curves"):
            plot_curves(run, cfg.env.id)
        run.close()


def train(cfg: TrainConfig) -> dict[str, float]:
    return asyncio.run(train_async(cfg))


__all__ = ["agent_spec", "check_run_dir", "ensure_model", "train", "train_async"]

"""The held-out tasks of a run: their evaluation at each stage (``init``, ``sft``,
``step-N``, ``rl``; logged to ``eval.jsonl``) and the training rows, which never include one.

The held-out tasks are the last ``eval.num_tasks`` rows of ``data.path``, or the env's draws
from ``eval.seed``; training draws from ``data.seed`` less those equal to a held-out draw. A
``data.train_filter`` then picks among the training rows.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING

from palaestra.run.clock import phase
from palaestra.run.config import TrainConfig
from palaestra.run.services import run_env_kwargs

if TYPE_CHECKING:
    from palaestra.agents.spec import AgentSpec
    from palaestra.engine import Engine
    from palaestra.run.run_dir import RunDir


async def evaluate_stage(
    cfg: TrainConfig, run: RunDir, engine: Engine, spec: AgentSpec, stage: str,
    step: int | None = None,
) -> dict[str, float]:
    """Success rate on the fixed held-out tasks; logged to eval.jsonl under ``stage``."""
    with phase(_PHASE_OF_EVAL.get(stage, "evals")):
        return await _evaluate_stage(cfg, run, engine, spec, stage, step)


_PHASE_OF_EVAL = {"init": "init eval"}


async def _evaluate_stage(
    cfg: TrainConfig, run: RunDir, engine: Engine, spec: AgentSpec, stage: str, step: int | None
) -> dict[str, float]:
    from palaestra.run.tasks import evaluate_tasks, tasks_from_env

    rows = tasks_from_env(
        cfg.env.id, cfg.eval.num_tasks, seed=cfg.eval.seed, env_kwargs=cfg.env.kwargs
    ) if cfg.data.path is None else eval_rows_from_file(cfg)
    start = time.perf_counter()
    metrics, episodes = await evaluate_tasks(
        engine, spec, cfg.env.id, rows, cfg.rollout.sampling(cfg.eval.temperature),
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


def eval_rows_from_file(cfg: TrainConfig) -> list[dict[str, object]]:
    """The held-out rows: the last ``eval.num_tasks`` rows of ``data.path`` (never trained on)."""
    from palaestra.rollout.data import load_rows, split_held_out

    return split_held_out(load_rows(str(cfg.data.path)), cfg.eval.num_tasks)[1]


def train_rows(cfg: TrainConfig) -> list[dict[str, object]]:
    """Training tasks, never a held-out one: a file's rows before its held-out tail, or the
    env's draws less those equal to a held-out draw (envs with a finite dataset repeat tasks)."""
    from palaestra.rollout.data import load_rows, split_held_out, without_tasks
    from palaestra.run.tasks import tasks_from_env

    if cfg.data.path is None:
        rows = tasks_from_env(
            cfg.env.id, cfg.data.num_tasks, seed=cfg.data.seed, env_kwargs=cfg.env.kwargs
        )
        return filtered_rows(cfg, without_tasks(rows, tasks_from_env(
            cfg.env.id, cfg.eval.num_tasks, seed=cfg.eval.seed, env_kwargs=cfg.env.kwargs)))
    rows = load_rows(str(cfg.data.path))
    train = split_held_out(rows, cfg.eval.num_tasks)[0]  # the held-out tail is never trained on
    return filtered_rows(cfg, train)


def filtered_rows(cfg: TrainConfig, rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """``rows`` through ``data.train_filter`` (unchanged without one). The filter sees only
    training rows, so it can never bring a held-out one back."""
    import importlib

    from palaestra.errors import ConfigError

    target = cfg.data.train_filter
    if not target:
        return rows
    module_name, _, attr = target.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"data.train_filter = {target!r}: cannot load it ({exc})") from None
    kept = list(fn(list(rows), env_kwargs=dict(cfg.env.kwargs)))
    if not kept:
        raise ConfigError(f"data.train_filter = {target!r} kept none of the {len(rows)} training "
                          "rows: check the filter and env.kwargs, or unset data.train_filter")
    print(f"[data] {target} keeps {len(kept)} of {len(rows)} training rows", flush=True)
    return kept


__all__ = ["eval_rows_from_file", "evaluate_stage", "filtered_rows", "train_rows"]

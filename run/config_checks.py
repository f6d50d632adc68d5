"""The checks of a `RunSettings` that span fields or look outside it (env registry, data files).

`config_problems` runs when the config is validated (``RunSettings``'s model validator), so
``palaestra train CONFIG --dry-run`` refuses everything a run would die of later: an unknown env
id (with its close match), env kwargs its constructor does not take, a missing, empty or broken
task file (every bad row named, the first ones when there are many), rows without the fields the
env's ``reset`` needs, too few rows to hold out ``eval.num_tasks`` and train on the rest, loss
settings the loop cannot serve (a policy backend turned critic, PPO's [critic] settings, group
baselines over groups of one, KL without a reference model, an offline objective in an RL run),
and data that runs out before the last step. `launch_problems` adds what only the machine that
trains can tell (the model is there). Nothing heavy is imported: env classes are imported, never
built; no torch.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from palaestra.config import Problem
from palaestra.errors import ConfigError, EnvNotFoundError

if TYPE_CHECKING:
    from palaestra.rollout.task_checks import RowCheck, RowScan
    from palaestra.run.sections import RunSettings

#: advantage estimators that compare a sample with the other samples of its group
GROUP_BASELINES = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "tree")
CRITIC_FREE_PRESETS = "grpo, dr_grpo, dapo, gspo, rloo, reinforce_pp, reinforce_pp_baseline"


def config_problems(cfg: RunSettings) -> list[Problem]:
    """Every problem of ``cfg`` that the field types alone do not catch."""
    out = _engine_problems(cfg) + _rollout_problems(cfg) + _agent_problems(cfg)
    out += _env_and_data_problems(cfg)
    if cfg.algorithm == "rl":
        out += _loss_problems(cfg)
    else:
        out += _offline_problems(cfg)
    if cfg.warmup.steps > 0:
        out += _demonstration_problems(cfg)
    out += _reward_problems(cfg)
    from palaestra.run.phases.distill import distill_problems
    from palaestra.run.trainer_plan import placement_problems
    from palaestra.run.fleet.start import engine_actor_problems
    from palaestra.run.services import services_problems

    from palaestra.run.on_policy import on_policy_problems

    out += distill_problems(cfg) + on_policy_problems(cfg)
    from palaestra.run.fleet.router import router_problems

    out += router_problems(cfg)
    return out + services_problems(cfg) + placement_problems(cfg) + engine_actor_problems(cfg)


def launch_problems(cfg: RunSettings) -> list[Problem]:
    """Problems a real run has on this machine (a dry run only plans, e.g. for a GPU host)."""
    from palaestra.run.fleet.router import router_launch_problems

    return router_launch_problems(cfg) + _model_launch_problems(cfg)


def _model_launch_problems(cfg: RunSettings) -> list[Problem]:
    """The policy checkpoint is there (or the config says how to build it)."""
    from palaestra.model_import import KNOWN_MODELS

    path = cfg.in_run(cfg.model.path)
    if cfg.model.init_from is not None and cfg.model.init_from not in KNOWN_MODELS:
        return [Problem(("model.init_from",), (
            f"model.init_from = {cfg.model.init_from!r} is not a known model; choose one of "
            f"{sorted(KNOWN_MODELS)} (or convert a GGUF with `palaestra init-model --from-gguf`)"))]
    if cfg.model.init_size is None and cfg.model.init_from is None and not (
        path / "config.json"
    ).is_file():
        return [Problem(("model.path",), (
            f"model.path = {cfg.model.path!r}: no Hugging Face checkpoint there (no "
            f"config.json in {str(path)!r}); point model.path at one, or set "
            "--model.init_size tiny to build a local model there"))]
    return []


def _engine_kind_problems(cfg: RunSettings) -> list[Problem]:
    """Settings of ``engine.weight_sync`` (kind auto) that the embedded engine's in-process sync
    never reads; the other kinds refuse the settings they do not have as unknown fields. Not
    checked so, on purpose: the settings of the other ``engine.kind`` (the shipped local configs
    set ``engine.device``, and switching one to servers with ``--engine.kind sglang
    --engine.urls ...`` is a documented use) and of the other ``trainer.backend`` (shipped
    configs carry ``[trainer.torch]`` and ``[trainer.megatron]``, and a script picks one with
    ``--trainer.backend megatron``)."""
    e, out = cfg.engine, list[Problem]()
    sync = e.weight_sync
    if sync.kind != "auto" or e.kind != "local":
        return out  # auto for servers: distributed or disk, decided by CUDA at run time
    # given and not at its default: a resolved config.json (a resume) sets every field
    fields = type(sync).model_fields
    for name in sorted(sync.model_fields_set - {"kind", "dtype"}):
        if getattr(sync, name) != fields[name].get_default(call_default_factory=True):
            out.append(Problem((f"engine.weight_sync.{name}", "engine.weight_sync.kind"), (
                f"engine.weight_sync.{name} is a setting of the servers' sync (kind = "
                "'distributed' / 'disk'); the 'in_process' sync of the embedded engine never "
                "reads it: remove it, or set engine.kind = 'sglang'")))
    return out


def _engine_problems(cfg: RunSettings) -> list[Problem]:
    e, out = cfg.engine, _engine_kind_problems(cfg)
    from palaestra.run.fleet.start import engine_actor_count

    if e.kind == "sglang" and not e.urls and e.launch == "none" and not engine_actor_count(cfg):
        out.append(Problem(("engine",), "engine.kind = 'sglang' needs engine.urls (attach to "
                           "running servers) or engine.launch = 'sglang' / 'palaestra' (start them)"))
    if e.launch != "none" and e.kind != "sglang":
        out.append(Problem(("engine.launch", "engine.kind"),
                           "engine.launch starts servers: set engine.kind = 'sglang' too"))
    if e.launch_gpus and len(e.launch_gpus) % e.launch_tp:
        out.append(Problem(("engine.launch_gpus", "engine.launch_tp"), (
            f"engine.launch_gpus ({len(e.launch_gpus)} GPUs) do not split into groups of "
            f"engine.launch_tp = {e.launch_tp}")))
    if e.launch == "palaestra" and e.launch_tp > 1:
        out.append(Problem(("engine.launch", "engine.launch_tp"),
                           "palaestra serve runs one GPU per server: set engine.launch_tp = 1"))
    if e.kind == "local" and e.weight_sync.kind not in ("auto", "in_process"):
        out.append(Problem(("engine.weight_sync", "engine.kind"), (
            f"engine.weight_sync.kind = {e.weight_sync.kind!r} needs SGLang servers (engine.kind"
            " = 'sglang'); the embedded engine is updated in process")))
    if e.kind == "sglang" and e.weight_sync.kind == "in_process":
        out.append(Problem(("engine.weight_sync", "engine.kind"), (
            "engine.weight_sync.kind = 'in_process' needs the embedded engine; for SGLang servers "
            "use distributed, disk or tensor")))
    from palaestra.trainers.megatron.config import megatron_installed

    if cfg.trainer.backend == "megatron" and not megatron_installed():
        out.append(Problem(("trainer.backend",), (
            "trainer.backend = 'megatron' needs megatron-core (pip install "
            "'palaestra[megatron]' on a CUDA machine; see docs/megatron.md)")))
    return out


def _rollout_problems(cfg: RunSettings) -> list[Problem]:
    from palaestra.rollout.config import rollout_problems

    r = cfg.rollout
    out = rollout_problems(r)  # the section's own (what RolloutManager checks too)
    if r.max_new_tokens >= cfg.agent.max_context:
        out.append(Problem(("rollout.max_new_tokens", "agent.max_context"), (
            f"rollout.max_new_tokens = {r.max_new_tokens} leaves no room for the prompt in "
            f"agent.max_context = {cfg.agent.max_context} tokens; raise agent.max_context or "
            "lower max_new_tokens")))
    return out


def _agent_problems(cfg: RunSettings) -> list[Problem]:
    from palaestra.agents.renderers import ALIASES, FAMILIES
    from palaestra.tiny_model import SIZES

    out = []
    family = cfg.agent.family.strip().lower()
    if family not in FAMILIES and family not in ALIASES:
        out.append(Problem(("agent.family",), (
            f"agent.family = {cfg.agent.family!r} is not a known renderer family; use one of "
            f"{sorted(set(FAMILIES) | set(ALIASES))}")))
    if cfg.model.init_size is not None and cfg.model.init_size not in SIZES:
        out.append(Problem(("model.init_size",), (
            f"model.init_size = {cfg.model.init_size!r} is not a local model size; use one of "
            f"{sorted(SIZES)}")))
    return out


def _env_and_data_problems(cfg: RunSettings) -> list[Problem]:
    from palaestra.rollout.task_checks import env_class, task_row_check, unknown_kwargs

    out = []
    try:
        cls = env_class(cfg.env.id)
    except EnvNotFoundError as exc:
        out.append(Problem(("env.id",), f"env.id = {cfg.env.id!r}: {exc}"))
        env_ok = False
    else:
        env_ok = True
        unknown = unknown_kwargs(cls, cfg.env.kwargs) if cls is not None else []
        if unknown and cls is not None:
            out.append(Problem(("env.kwargs",), (
                f"env.kwargs: {cls.__name__} ({cfg.env.id}) takes no {', '.join(unknown)}; "
                "see its docstring (`palaestra envs list`) for its arguments")))
    if cfg.algorithm != "rl":
        return out
    d = cfg.data
    if d.train_filter is not None:
        out += _entry_point_problems("data.train_filter", d.train_filter)
    if d.path is None:
        return out + _epoch_problems(cfg, d.num_tasks, "data.num_tasks")
    if not d.path.strip():
        return out + [Problem(("data.path",), (
            "data.path is empty: give a task file (.jsonl/.json/.parquet/datasets folder), or "
            "leave data.path unset to draw tasks from the env"))]
    if not env_ok:
        return out  # the rows are checked against the env once its id is fixed
    scan = _scan(d.path, task_row_check(cfg.env.id), "data.path")
    if isinstance(scan, Problem):
        return out + [scan]
    if scan.problems:
        out.append(Problem(("data.path",), f"data.path = {d.path!r}: {scan.describe()}"))
    held_out = cfg.eval.num_tasks
    if held_out >= scan.num_rows:
        out.append(Problem(("data.path", "eval.num_tasks"), (
            f"data.path = {d.path!r} has {scan.num_rows} rows, too few to hold out "
            f"eval.num_tasks = {held_out} (its last rows, never trained on) and train on the "
            f"rest; lower --eval.num_tasks (e.g. {max(1, scan.num_rows // 5)}) or add rows")))
        return out
    return out + _epoch_problems(cfg, scan.num_rows - held_out, "data.path")


def _epoch_problems(cfg: RunSettings, num_tasks: int, source: str) -> list[Problem]:
    epochs = cfg.data.epochs
    needed = cfg.trainer.steps * cfg.rollout.batch_size
    if epochs is None or num_tasks * epochs >= needed:
        return []
    return [Problem((source, "data.epochs", "trainer.steps", "rollout.batch_size"), (
        f"data.epochs = {epochs} over {num_tasks} training tasks gives {num_tasks * epochs} "
        f"prompts, but trainer.steps x rollout.batch_size = {needed}; raise data.epochs, unset "
        "it (endless passes), or lower trainer.steps"))]


def _scan(path: str, check: RowCheck, field: str) -> RowScan | Problem:
    from palaestra.rollout.task_checks import scan_rows

    try:
        return scan_rows(path, check)
    except ConfigError as exc:
        return Problem((field,), f"{field} = {path!r}: {exc}")


def _loss_problems(cfg: RunSettings) -> list[Problem]:
    loss, out = cfg.trainer.loss, []
    preset = f" (preset {loss.preset!r})" if loss.preset else ""
    if loss.objective != "rl":
        out.append(Problem(("trainer.loss",), (
            f"trainer.loss.objective = {loss.objective!r}{preset} trains offline, not from env "
            f"rewards; for RL choose a preset of {CRITIC_FREE_PRESETS}, or set algorithm = "
            f"{loss.objective!r} with offline.dataset")))
        return out
    from palaestra.run.phases.critic import critic_problems

    out += critic_problems(cfg)  # GAE's critic ([critic]), PPO's mini-batches
    backend = cfg.trainer.megatron if cfg.trainer.backend == "megatron" else cfg.trainer.torch
    section = f"trainer.{cfg.trainer.backend}"
    # pure on-policy distillation (no env reward in the advantage) compares no samples
    pure_distill = cfg.distill.teacher is not None and cfg.distill.reward_coef == 0
    if (loss.advantage_estimator in GROUP_BASELINES and cfg.rollout.group_size < 2
            and not pure_distill):
        out.append(Problem(("rollout.group_size", "trainer.loss"), (
            f"rollout.group_size = {cfg.rollout.group_size} with "
            f"{loss.advantage_estimator!r} advantages{preset}: each sample is compared with the "
            "other samples of its group, so a group of one has advantage 0 and nothing is "
            "trained; set --rollout.group_size 2 or more (e.g. 8), or use "
            "--trainer.loss.preset reinforce_pp (a batch baseline)")))
    if loss.advantage_estimator == "tree" and (loss.use_turn_rewards or (
            loss.kl_mode == "reward" and loss.kl_coef > 0)):
        out.append(Problem(("trainer.loss",), (
            "trainer.loss.advantage_estimator = 'tree' values each node by its leaves' outcome "
            "rewards; set --trainer.loss.use_turn_rewards false and --trainer.loss.kl_mode loss "
            "(or use another estimator)")))
    if loss.kl_coef > 0 and not getattr(backend, "ref_model", False):
        where = " (in the reward)" if loss.kl_mode == "reward" else ""
        out.append(Problem(("trainer.loss.kl_coef", f"{section}.ref_model"), (
            f"trainer.loss.kl_coef = {loss.kl_coef}{where} needs a reference model to "
            f"measure the KL against; set --{section}.ref_model true (a frozen copy of the "
            "initial policy), or --trainer.loss.kl_coef 0")))
    return out


def _offline_problems(cfg: RunSettings) -> list[Problem]:
    from palaestra.rollout.task_checks import field_check

    dataset = cfg.offline.dataset
    if not dataset:
        return [Problem(("offline.dataset", "algorithm"),
                        f"algorithm = {cfg.algorithm!r} needs offline.dataset (a JSONL file)")]
    fields = ("messages",) if cfg.algorithm == "sft" else ("prompt", "chosen", "rejected")
    scan = _scan(dataset, field_check(*fields), "offline.dataset")
    if isinstance(scan, Problem):
        return [scan]
    if scan.problems:
        return [Problem(("offline.dataset",), f"offline.dataset = {dataset!r}: {scan.describe()}")]
    return []


def _reward_problems(cfg: RunSettings) -> list[Problem]:
    """``[[rewards]]``: only RL episodes are scored; unique names; a classifier checkpoint that
    is there (a judge's server is reached only when the run starts)."""
    from palaestra.rollout.rewards.config import check_sources

    if not cfg.rewards:
        return []
    if cfg.algorithm != "rl":
        return [Problem(("rewards", "algorithm"), (
            f"[[rewards]] score RL episodes; algorithm = {cfg.algorithm!r} trains on a dataset: "
            "remove the [[rewards]] entries or set algorithm = 'rl'"))]
    out = [Problem(("rewards",), p) for p in check_sources(cfg.rewards)]
    for i, src in enumerate(cfg.rewards):
        if src.kind == "classifier" and not (Path(str(src.path)) / "config.json").is_file():
            out.append(Problem((f"rewards.{i}.path",), (
                f"rewards[{i}] ({src.part_name}): no Hugging Face checkpoint at {src.path!r} (no "
                "config.json); train one with algorithm = 'rm' (its <out>/final-model) or point "
                "path at a sequence-classification checkpoint")))
    if cfg.reward_worker.placement == "actor" and cfg.rollout.cluster != "ray":
        out.append(Problem(("reward_worker.placement", "rollout.cluster"), (
            "reward_worker.placement = 'actor' runs a Ray actor: set rollout.cluster = 'ray', or "
            "placement = 'inline' (the sources run in this process)")))
    return out


def _entry_point_problems(key: str, source: str) -> list[Problem]:
    """A ``module:function`` setting that does not name an importable function."""
    module_name, _, attr = source.partition(":")
    if not module_name or not attr:
        return [Problem((key,), f"{key} = {source!r}: write it as module:function")]
    try:
        fn = getattr(importlib.import_module(module_name), attr, None)
    except ImportError as exc:
        return [Problem((key,), f"{key} = {source!r}: cannot import it ({exc})")]
    if not callable(fn):
        return [Problem((key,), f"{key} = {source!r}: {module_name} has no function {attr!r}")]
    return []


def _demonstration_problems(cfg: RunSettings) -> list[Problem]:
    from palaestra.rollout.task_checks import field_check

    source = cfg.warmup.demonstrations
    if not source:
        return [Problem(("warmup.demonstrations", "warmup.steps"), (
            "warmup.steps > 0 needs warmup.demonstrations (a JSONL of transcripts, or "
            "module:function), or set warmup.steps = 0"))]
    if ":" in source and not Path(source).exists():  # module:function, as offline.py reads it
        return _entry_point_problems("warmup.demonstrations", source)
    scan = _scan(source, field_check("messages"), "warmup.demonstrations")
    if isinstance(scan, Problem):
        return [scan]
    if scan.problems:
        return [Problem(("warmup.demonstrations",),
                        f"warmup.demonstrations = {source!r}: {scan.describe()}")]
    return []


__all__ = ["GROUP_BASELINES", "config_problems", "launch_problems"]

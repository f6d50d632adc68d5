"""`build_critic`: PPO's value model on the torch or Megatron backend, beside the policy.

The critic's backend settings are the policy backend's (``trainer.torch`` / ``trainer.megatron``)
with ``critic = true``, no reference model, the ``[critic]`` optimizer settings and the
``critic.torch`` / ``critic.megatron`` overrides on top; they are validated when the config is
loaded (`critic_backend_settings` is what ``config_checks`` calls).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from palaestra.run.sections import RunSettings


def critic_backend_name(cfg: RunSettings) -> str:
    """``critic.backend``, defaulting to ``trainer.backend``."""
    return cfg.critic.backend or cfg.trainer.backend


def uses_critic(cfg: RunSettings) -> bool:
    """Whether this run trains a critic: RL with GAE advantages (the ``ppo`` preset)."""
    return cfg.algorithm == "rl" and cfg.trainer.loss.needs_values


def optimizer_steps(cfg: RunSettings) -> int:
    """Optimizer steps per model over the run: steps x epochs x mini-batches per epoch."""
    per_batch = cfg.rollout.batch_size * cfg.rollout.group_size
    mini = cfg.trainer.mini_batch_size or per_batch
    return cfg.trainer.steps * cfg.trainer.updates_per_batch * max(1, -(-per_batch // mini))


def critic_backend_settings(cfg: RunSettings) -> Any:
    """The critic's `TorchBackendConfig` or `MegatronBackendConfig` (raises pydantic's
    ValidationError on a bad ``critic.torch`` / ``critic.megatron`` key)."""
    from palaestra.trainers.megatron.config import MegatronBackendConfig
    from palaestra.trainers.torch_backend.config import TorchBackendConfig

    c = cfg.critic
    megatron = critic_backend_name(cfg) == "megatron"
    base = cfg.trainer.megatron if megatron else cfg.trainer.torch
    changes: dict[str, Any] = {
        "critic": True, "ref_model": False, "lr": c.lr, "lr_schedule": c.lr_schedule,
        "warmup_steps": c.lr_warmup_steps, "seed": cfg.seed,
        "total_steps": optimizer_steps(cfg) if c.lr_schedule != "constant" else None,
    }
    if c.max_tokens_per_micro_batch is not None:
        changes["max_tokens_per_micro_batch"] = c.max_tokens_per_micro_batch
    if not megatron:
        changes["ref_model_path"] = None
        changes["on_policy"] = "default"  # values are no sampled logprobs
    data = {**base.model_dump(), **changes, **(c.megatron if megatron else c.torch)}
    cls = MegatronBackendConfig if megatron else TorchBackendConfig
    return cls.model_validate(data)


def critic_model_path(cfg: RunSettings, policy_path: Path) -> Path:
    """Where the critic starts: ``critic.model_path`` or the RL phase's initial policy."""
    if cfg.critic.model_path:
        return cfg.in_run(cfg.critic.model_path)
    return policy_path


def build_critic(cfg: RunSettings, policy_path: Path) -> Any:
    """The critic backend (``forward_values``, ``train_step``, ``save``/``load``)."""
    settings = critic_backend_settings(cfg)
    path = critic_model_path(cfg, policy_path)
    if critic_backend_name(cfg) == "megatron":
        from transformers import AutoConfig

        from palaestra.trainers.megatron.backend import MegatronBackend

        return MegatronBackend(AutoConfig.from_pretrained(path), settings, model_path=path)
    from palaestra.trainers.torch_backend.backend import TorchBackend

    return TorchBackend(path, settings)



def critic_problems(cfg: RunSettings) -> list[Any]:
    """The ``[critic]`` and mini-batch settings a run cannot serve (`config_checks` runs it)."""
    from pydantic import ValidationError

    from palaestra.config import Problem

    out: list[Any] = []
    for name in ("torch", "megatron"):
        if getattr(getattr(cfg.trainer, name), "critic", False):
            out.append(Problem((f"trainer.{name}.critic",), (
                f"trainer.{name}.critic = true would turn the policy into a value model; PPO's "
                f"critic is the [critic] section (on with trainer.loss.preset = 'ppo'): set "
                f"--trainer.{name}.critic false")))
    if not uses_critic(cfg):
        if cfg.trainer.mini_batch_size is not None:
            out.append(Problem(("trainer.mini_batch_size", "trainer.loss"), (
                "trainer.mini_batch_size splits PPO's epochs (a critic, advantage_estimator = "
                "'gae'); this loss trains on the whole batch: unset it, or use "
                "--trainer.loss.preset ppo")))
        return out
    placement = getattr(cfg, "placement", None)
    if placement is not None and (placement.trainer_ranks > 1 or placement.critic_ranks > 0):
        out.append(Problem(("placement", "critic.placement"), (
            "PPO's critic trains in the trainer process beside a one-process policy for now "
            "(critic.placement = 'colocate'); a trainer group for the policy or for the critic "
            "is not built for PPO yet: set placement.trainer_ranks = 1 and "
            "placement.critic_ranks = 0")))
    if "value_clip" in cfg.trainer.loss.model_fields_set:
        out.append(Problem(("trainer.loss.value_clip", "critic.value_clip"), (
            "the critic's value clip is critic.value_clip; unset trainer.loss.value_clip")))
    try:
        settings = critic_backend_settings(cfg)
    except ValidationError as exc:
        section = f"critic.{critic_backend_name(cfg)}"
        errors = "; ".join(f"{'.'.join(map(str, e['loc'])) or section}: {e['msg']}"
                           for e in exc.errors())
        return out + [Problem((section,), f"{section}: {errors}")]
    if critic_backend_name(cfg) == "megatron" and cfg.trainer.backend == "megatron":
        policy = cfg.trainer.megatron
        layout = ("tp", "pp", "ep", "expert_tp")
        if any(getattr(settings, k) != getattr(policy, k) for k in layout):
            out.append(Problem(("critic.megatron",), (
                "the critic runs in the policy's process, so it shares megatron's parallel "
                "layout: drop tp/pp/ep/expert_tp from critic.megatron")))
    if critic_backend_name(cfg) == "megatron" and cfg.trainer.backend != "megatron":
        from palaestra.trainers.megatron.config import megatron_installed

        if not megatron_installed():
            out.append(Problem(("critic.backend",), (
                "critic.backend = 'megatron' needs megatron-core (pip install "
                "'palaestra[megatron]' on a CUDA machine); or --critic.backend torch")))
    return out


def critic_plan_line(cfg: RunSettings) -> str:
    """The dry run's line on the critic (whether there is one, and how it trains)."""
    if not uses_critic(cfg):
        return f"critic: none ({cfg.trainer.loss.advantage_estimator} advantages need no values)"
    c, t = cfg.critic, cfg.trainer
    start = c.model_path or "the RL phase's initial policy"
    mini = (f"mini-batches of {t.mini_batch_size} samples" if t.mini_batch_size
            else "the whole batch")
    clip = f"value clip {c.value_clip}" if c.value_clip is not None else "no value clip"
    warm = f", critic-only warm-up {c.warmup_steps} steps" if c.warmup_steps else ""
    return (f"critic: value model from {start} with a fresh value head, backend "
            f"{critic_backend_name(cfg)}, {c.placement} with the policy, lr {c.lr} "
            f"({c.lr_schedule}), {clip}{warm}; PPO: {t.updates_per_batch} epoch(s) over {mini}, "
            f"actor and critic updated per mini-batch, only the actor's weights go to the engines")


__all__ = ["build_critic", "critic_backend_name", "critic_backend_settings", "critic_model_path",
           "critic_plan_line", "critic_problems", "optimizer_steps", "uses_critic"]

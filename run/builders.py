"""The objects a training run is made of, from plain settings: the agent spec, the engine, the
training backend and its per-phase settings.

Each builder takes the config sections (or values) it reads, never the whole `TrainConfig`, and
returns a typed object, so a reader sees what a builder depends on. `palaestra.run.rl`
(RL) and `palaestra.run.phases.offline` (SFT/DPO) both build from here (neither imports the
other for it).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from palaestra.agents import AgentSpec
    from palaestra.contracts import TrainerBackend
    from palaestra.engines.clients.sglang import SGLangEngine
    from palaestra.engines.local.local import LocalEngine
    from palaestra.run.fleet.placement import RunPlan
    from palaestra.run.sections import AgentSection, EngineSection, TrainerSection
    from palaestra.trainers.algorithms.config import LossConfig
    from palaestra.trainers.batching import TrainBatch
    from palaestra.trainers.megatron.backend import MegatronBackend
    from palaestra.trainers.megatron.config import MegatronBackendConfig
    from palaestra.trainers.torch_backend.config import TorchBackendConfig


def agent_spec(agent: AgentSection, tokenizer_path: Path) -> AgentSpec:
    """The agent of every episode: ``[agent]``'s renderer family and context on the policy's
    tokenizer."""
    from palaestra.agents import AgentSpec

    return AgentSpec(
        str(tokenizer_path),
        family=agent.family,
        max_context=agent.max_context,
        drift_rate=agent.drift_rate,
        strict_drift=agent.strict_drift,
        tools_in_prompt=agent.tools_in_prompt,
    )


def build_engine(engine: EngineSection, model_path: Path, *, max_model_len: int, seed: int,
                 servers_dir: Path, bitwise: bool = False) -> LocalEngine | SGLangEngine:
    """The embedded engine (``engine.kind = "local"``; ``bitwise``: in bitwise on-policy mode),
    or a client over SGLang servers (``engine.urls`` and the ones ``engine.launch`` starts,
    logging to ``servers_dir``)."""
    if engine.kind == "sglang":
        from palaestra.run.fleet.launch import launched_engine

        launched: SGLangEngine = launched_engine(engine, model_path, servers_dir)
        return launched
    from palaestra.engines.local.local import LocalEngine

    return LocalEngine(
        model_path,
        device=engine.device,
        max_running=engine.max_running,
        max_model_len=max_model_len,
        seed=seed,
        decode_steps=engine.decode_steps,
        decode_attention=engine.decode_attention,
        # async mode too: the engine captures its graphs thread-locally on its own stream, so
        # the training thread's kernels beside them neither fail nor serialise with decode
        cuda_graphs=True,
        bitwise=bitwise,
    )


def megatron_backend(megatron: MegatronBackendConfig, model_path: Path, *, seed: int,
                     steps: int, **changes: Any) -> MegatronBackend:
    """A Megatron-core backend on ``model_path`` from ``trainer.megatron`` (seeded, its schedule
    over ``steps``), with ``changes`` to those settings."""
    from transformers import AutoConfig

    from palaestra.trainers.megatron.backend import MegatronBackend

    return MegatronBackend(AutoConfig.from_pretrained(model_path),
                           megatron_config(megatron, seed=seed, steps=steps, **changes),
                           model_path=model_path)


def megatron_config(megatron: MegatronBackendConfig, *, seed: int, steps: int,
                    **changes: Any) -> MegatronBackendConfig:
    """``trainer.megatron`` seeded, with its schedule over ``steps`` and ``changes``."""
    changes = {"seed": seed, **changes}
    if megatron.lr_schedule != "constant":
        changes["total_steps"] = steps
    return megatron.model_copy(update=changes)


def backend_config(torch_cfg: TorchBackendConfig, *, temperature: float, seed: int,
                   lr: float | None = None, steps: int | None = None) -> TorchBackendConfig:
    """The torch backend settings of a phase: logits scaled by the sampling ``temperature``,
    seeded, the learning-rate schedule over ``steps``."""
    changes: dict[str, Any] = {"logits_temperature": temperature, "seed": seed}
    if lr is not None:
        changes["lr"] = lr
    if steps is not None and torch_cfg.lr_schedule != "constant":
        changes["total_steps"] = steps
    return torch_cfg.model_copy(update=changes)


def build_backend(trainer: TrainerSection, policy_path: Path, *, temperature: float, seed: int,
                  optimizer_steps: int | None = None,
                  group: RunPlan | None = None, ray_address: str | None = None,
                  placement_group: object = None, ready_timeout_s: float = 300.0
                  ) -> TrainerBackend[TrainBatch, LossConfig]:
    """The RL training backend: the PyTorch one, Megatron-core on CUDA machines, or (``group``:
    the plan of ``[placement]`` with several trainer ranks) PyTorch ranks as Ray actors
    (``placement_group``: in the one the colocated engine actors reserved for both; a group
    not placed within ``ready_timeout_s`` fails the run with what the cluster has). A decaying
    learning rate spans ``optimizer_steps`` (default ``trainer.steps``): with several updates
    per rollout batch it would otherwise reach its floor part of the way through the run."""
    steps = optimizer_steps or trainer.steps
    if trainer.backend == "megatron":
        if group is not None:  # Megatron ranks as Ray actors (tp/ep from trainer.megatron)
            from palaestra.trainers.group.group import TrainerGroup

            return TrainerGroup(policy_path, megatron_config(
                trainer.megatron, seed=seed, steps=steps,
                logits_temperature=temperature), group, address=ray_address,
                placement_group=placement_group, ready_timeout_s=ready_timeout_s).start()
        return megatron_backend(trainer.megatron, policy_path, seed=seed, steps=steps,
                                logits_temperature=temperature)
    torch_cfg = backend_config(trainer.torch, temperature=temperature, seed=seed, steps=steps)
    if group is not None:  # [placement] trainer_ranks: Ray actors on a placement group
        from palaestra.trainers.group.group import TrainerGroup

        return TrainerGroup(policy_path, torch_cfg, group, address=ray_address,
                            placement_group=placement_group,
                            ready_timeout_s=ready_timeout_s).start()
    from palaestra.trainers.torch_backend.backend import TorchBackend

    return TorchBackend(policy_path, torch_cfg)


__all__ = ["agent_spec", "backend_config", "build_backend", "build_engine", "megatron_backend",
           "megatron_config"]

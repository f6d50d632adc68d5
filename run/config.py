"""``TrainConfig``: the typed config tree of ``palaestra train`` (TOML + dotted overrides).

Torch-free: the command validates the whole file (every problem at once) before importing torch:
the field types and ranges here, the checks across fields and against the env registry and the
data files in `palaestra.run.config_checks` (run by ``TrainConfig``'s validator).
The sections (`palaestra.run.sections`) map onto the builders of a run: ``model`` (checkpoint or a tiny model built
locally), ``env``/``data`` (tasks), ``agent`` (renderer family), ``rollout`` (groups, sampling,
workers, sync/async), ``engine`` (embedded or SGLang servers), ``warmup`` (SFT warm start on
demonstrations), ``trainer`` (backend, optimiser, loss), ``eval``, ``checkpoint``, ``logging``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, model_validator

from palaestra.config import ConfigProblems, Section
from palaestra.rollout.config import RolloutConfig
from palaestra.rollout.rewards.config import RewardSourceConfig, RewardWorkerSection
from palaestra.run.evaluation import EvalConfig as BenchmarkEvalConfig
from palaestra.run.fleet.placement import PlacementSection
from palaestra.run.sections import (
    AgentSection,
    CheckpointSection,
    DataSection,
    DistillSection,
    EngineSection,
    EnvSection,
    EvalSection,
    LoggingSection,
    ModelSection,
    OfflineSection,
    ServicesSection,
    TrainerSection,
    WarmupSection,
)
from palaestra.trainers.ppo.config import CriticSection


class TrainConfig(Section):
    """The whole run."""

    algorithm: Literal["rl", "sft", "dpo", "rm"] = "rl"
    """RL from env rewards (and ``[[rewards]]``), offline SFT / DPO on a dataset, or "rm": a
    Bradley-Terry reward model trained on the preference pairs of ``offline.dataset``."""
    out: str = "runs/train"
    """Run directory (config.json, metrics.jsonl, eval.jsonl, checkpoints/, curves.png)."""
    seed: int = 0
    """Global seed."""
    model: ModelSection = Field(default_factory=ModelSection)
    env: EnvSection = Field(default_factory=EnvSection)
    data: DataSection = Field(default_factory=DataSection)
    agent: AgentSection = Field(default_factory=AgentSection)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Groups, sampling, workers, sync/async: the `RolloutManager`'s own config object."""
    engine: EngineSection = Field(default_factory=EngineSection)
    warmup: WarmupSection = Field(default_factory=WarmupSection)
    offline: OfflineSection = Field(default_factory=OfflineSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    benchmark_eval: BenchmarkEvalConfig = Field(default_factory=BenchmarkEvalConfig)
    """Benchmarks (``palaestra eval`` registry) evaluated every ``interval`` RL steps."""
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    critic: CriticSection = Field(default_factory=CriticSection)
    """PPO's value model (used with ``trainer.loss.preset = "ppo"``, GAE advantages)."""
    services: ServicesSection = Field(default_factory=ServicesSection)
    """Processes the run starts beside itself (a retrieval server), stopped when it ends."""
    logging: LoggingSection = Field(default_factory=LoggingSection)
    rewards: list[RewardSourceConfig] = Field(default_factory=list)
    """Reward sources of RL episodes (``[[rewards]]``: classifier, judge, env; weighted sum).
    Empty: the env's reward alone."""
    reward_worker: RewardWorkerSection = Field(default_factory=RewardWorkerSection)
    """Where ``[[rewards]]`` models run (inline or a Ray actor), batching, timeouts, retries."""
    placement: PlacementSection | None = None
    """Trainer ranks and engine GPUs over the cluster's nodes (None: one trainer process)."""
    distill: DistillSection = Field(default_factory=DistillSection)
    """On-policy distillation from a teacher model (``distill.teacher``; None: plain RL)."""

    def in_run(self, path: str) -> Path:
        """A path setting with ``{out}`` (this run's directory) filled in."""
        return Path(path.replace("{out}", self.out))

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> TrainConfig:
        from palaestra.run.config_checks import config_problems, launch_problems

        problems = config_problems(self)
        if (info.context or {}).get("launch"):  # a run starts on this machine (not a dry run)
            problems += launch_problems(self)
        if problems:
            raise ConfigProblems(problems)
        return self

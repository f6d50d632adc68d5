"""Reward sources beside the env's reward (``[[rewards]]``): a classifier reward model, an LLM
judge and the env's own reward, scored by a reward worker as episodes finish.

Light to import: the sources load torch/transformers/engines only when they first score.
"""

from __future__ import annotations

from palaestra.rollout.rewards.config import (
    RewardError,
    RewardSourceConfig,
    RewardWorkerSection,
    check_sources,
)
from palaestra.rollout.rewards.scoring import (
    Part,
    ScoreRequest,
    ScoreResult,
    apply_score,
    combine,
    part_metrics,
)
from palaestra.rollout.rewards.worker import RewardClient, RewardWorker, reward_client

__all__ = [
    "Part",
    "RewardClient",
    "RewardError",
    "RewardSourceConfig",
    "RewardWorker",
    "RewardWorkerSection",
    "ScoreRequest",
    "ScoreResult",
    "apply_score",
    "check_sources",
    "combine",
    "part_metrics",
    "reward_client",
]

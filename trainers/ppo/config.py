"""``CriticSection``: the ``[critic]`` table of ``palaestra train`` (PPO's value model).

The critic is used when the loss needs values (``trainer.loss.preset = "ppo"``, i.e.
``advantage_estimator = "gae"``); its settings are ignored otherwise. By default it is the policy
checkpoint (the SFT warm start's export when there is one) with a fresh scalar value head in
place of the LM head, trained on the same backend and devices as the policy::

    [critic]
    lr = 1e-4
    warmup_steps = 2          # RL steps in which only the critic trains (verl's critic_warmup)
    value_clip = 0.2
    [critic.torch]            # any further trainer.torch setting, for the critic only
    gradient_checkpointing = true

Torch-free (pydantic only), like the rest of the config tree.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from palaestra.config import Section


class CriticSection(Section):
    model_path: str | None = None
    """Checkpoint the value model starts from (an HF causal LM gets a fresh value head; an
    ``*ForTokenClassification`` export of a critic keeps its head). None: the policy the RL
    phase starts from (``model.path``, or the SFT warm start's export)."""
    backend: Literal["torch", "megatron"] | None = None
    """Training backend of the critic; None: ``trainer.backend``."""
    lr: float = Field(1e-5, gt=0.0)
    """Peak learning rate of the critic's optimizer."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Critic learning rate after its warm-up: constant, or decaying over the run's optimizer
    steps (``trainer.steps`` x epochs x mini-batches)."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up of the critic, in optimizer steps."""
    max_tokens_per_micro_batch: int | None = Field(None, gt=0)
    """Token budget of one critic micro-batch; None: the policy backend's."""
    value_clip: float | None = Field(0.2, gt=0.0)
    """Clip range of the value update around the values at collection (PPO's clipped value
    loss); None: plain squared error. Replaces ``trainer.loss.value_clip``."""
    warmup_steps: int = Field(0, ge=0)
    """First RL steps in which only the critic trains: the policy is not updated (its weights
    and version still go to the engines), so the values fit before they steer the policy."""
    placement: Literal["colocate"] = "colocate"
    """Where the critic runs: "colocate" = in the trainer process, on the policy's devices
    (the only placement for now; a trainer group of its own comes with distributed training)."""
    torch: dict[str, object] = Field(default_factory=dict)
    """Further ``trainer.torch`` settings for the critic only (applied over the policy's)."""
    megatron: dict[str, object] = Field(default_factory=dict)
    """Further ``trainer.megatron`` settings for the critic only (applied over the policy's);
    in one process the critic shares the policy's tp/pp layout."""


__all__ = ["CriticSection"]

"""``LossConfig``: one typed description of the training objective, selectable from TOML.

It names the advantage estimator, the policy loss, the loss aggregation and every coefficient
(KL, entropy, clipping, truncated importance sampling, value clipping, DPO beta). Presets give
the published algorithms their usual settings; explicit keys override a preset::

    [trainer.loss]
    preset = "dr_grpo"      # grpo | dr_grpo | dapo | gspo | rloo | reinforce_pp |
                            # reinforce_pp_baseline | ppo | sft | dpo
    kl_coef = 0.001

This module imports no torch, so a command can validate its config before loading torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

AdvantageEstimator = Literal[
    "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "tree"
]
LossAggregation = Literal[
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "group-mean-token-mean",
]

#: preset name -> field values; the published defaults of each algorithm.
PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {"advantage_estimator": "grpo", "loss_agg": "seq-mean-token-mean"},
    "dr_grpo": {
        "advantage_estimator": "dr_grpo",
        "loss_agg": "seq-mean-token-sum-norm",
    },
    "dapo": {
        "advantage_estimator": "grpo",
        "clip_eps_low": 0.2,
        "clip_eps_high": 0.28,
        "loss_agg": "token-mean",
    },
    "gspo": {
        "advantage_estimator": "grpo",
        "policy_loss": "gspo",
        "clip_eps_low": 3e-4,
        "clip_eps_high": 4e-4,
        "loss_agg": "seq-mean-token-mean",
    },
    "rloo": {"advantage_estimator": "rloo", "loss_agg": "token-mean"},
    "reinforce_pp": {
        "advantage_estimator": "reinforce_pp",
        "kl_mode": "reward",
        "kl_estimator": "k1",
        "loss_agg": "token-mean",
    },
    "reinforce_pp_baseline": {
        "advantage_estimator": "reinforce_pp_baseline",
        "kl_estimator": "k3",
        "loss_agg": "token-mean",
    },
    "ppo": {"advantage_estimator": "gae", "gae_lambda": 0.95, "loss_agg": "token-mean"},
    "sft": {"objective": "sft", "loss_agg": "token-mean"},
    "dpo": {"objective": "dpo"},
}


class LossConfig(BaseModel):
    """The training objective: advantages, policy loss, aggregation and regularisers."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    preset: str | None = None
    """Name of a preset whose values fill every key not given explicitly (see ``PRESETS``)."""

    objective: Literal["rl", "sft", "dpo"] = "rl"
    """What is optimised: policy gradient ("rl"), masked NLL ("sft") or preference pairs ("dpo")."""

    advantage_estimator: AdvantageEstimator = "grpo"
    """How advantages are computed from rewards (``compute_advantages``)."""

    norm_adv_by_std: bool = True
    """GRPO and tree: divide the group-centred reward (tree: each turn's child-minus-parent
    value) by the group standard deviation."""

    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount over tokens (GAE, REINFORCE++) and over turns when per-turn rewards are used."""

    gae_lambda: float = Field(1.0, ge=0.0, le=1.0)
    """GAE's lambda (bias/variance trade-off of the PPO advantage)."""

    use_turn_rewards: bool = False
    """Use ``Sample.turn_rewards``: each turn's tokens get the discounted return from that turn."""

    policy_loss: Literal["ppo", "gspo"] = "ppo"
    """PPO token-level clipped ratio, or GSPO's sequence-level (length-normalised) ratio."""

    clip_eps_low: float = Field(0.2, ge=0.0, lt=1.0)
    """Lower clip range: the ratio is clipped at ``1 - clip_eps_low``."""

    clip_eps_high: float = Field(0.2, ge=0.0)
    """Upper clip range ``1 + clip_eps_high`` (DAPO's clip-higher uses 0.28)."""

    dual_clip_c: float | None = Field(None, gt=1.0)
    """Dual-clip constant c > 1: bounds the loss of negative-advantage tokens by ``c * |A|``."""

    loss_agg: LossAggregation = "token-mean"
    """How per-token losses become one number (see ``aggregation.loss_token_weights``)."""

    loss_agg_norm_len: int | None = Field(None, gt=0)
    """Constant length of "seq-mean-token-sum-norm" (Dr. GRPO); default: longest in the batch."""

    entropy_coef: float = Field(0.0, ge=0.0)
    """Entropy bonus: ``loss -= entropy_coef * entropy``."""

    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the KL divergence to the reference policy (0 disables it)."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman): k1 = log-ratio, k2 = squared/2, k3 = low-variance unbiased."""

    kl_mode: Literal["loss", "reward"] = "loss"
    """Add the KL to the loss, or subtract it from the token rewards before advantages."""

    tis_cap: float | None = Field(None, gt=0.0)
    """Truncated importance sampling: weight tokens by min(pi_old / pi_rollout, tis_cap)."""

    value_clip: float | None = Field(0.2, gt=0.0)
    """Clip range of the critic's value update (PPO's clipped value loss); None disables it."""

    skip_zero_advantage: bool = False
    """Leave the sequences whose every advantage is 0 out of the train step's forward and
    backward. They add nothing to the gradient of an "rl" objective without a KL loss term or an
    entropy bonus, so the update is the same for fewer tokens: with a sparse reward most GRPO
    groups score alike and their advantages are 0. The aggregation weights still come from the
    whole batch; the per-token statistics (``actor/entropy``, ``actor/clip_frac``, the logprob
    mismatch) are then over the sequences that trained, and ``actor/trained_weight`` is their
    share of the batch's loss weight."""

    dpo_beta: float = Field(0.1, gt=0.0)
    """DPO temperature beta."""

    dpo_label_smoothing: float = Field(0.0, ge=0.0, lt=0.5)
    """Conservative DPO: assumed probability that a preference label is flipped."""

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("preset") is None:
            return data
        name = data["preset"]
        if name not in PRESETS:
            raise ValueError(f"unknown loss preset {name!r}; choose one of {sorted(PRESETS)}")
        return {**PRESETS[name], **data}

    @model_validator(mode="after")
    def _coherent(self) -> LossConfig:
        if self.policy_loss == "gspo" and self.dual_clip_c is not None:
            raise ValueError("dual_clip_c bounds PPO's token loss and GSPO's sequence loss ignores "
                             "it: unset dual_clip_c or use policy_loss = 'ppo'")
        if self.skip_zero_advantage and not self.zero_advantage_adds_nothing:
            raise ValueError(
                "skip_zero_advantage leaves out sequences whose advantages are all 0, which is "
                "exact only when they add nothing to the gradient: use objective = 'rl' with "
                "entropy_coef = 0 and no KL loss term (kl_coef = 0 or kl_mode = 'reward'), or "
                "set skip_zero_advantage = false")
        return self

    @property
    def zero_advantage_adds_nothing(self) -> bool:
        """True when a token whose advantage is 0 has no gradient: the clipped policy loss
        (PPO or GSPO, with or without TIS) is ``A`` times a ratio, and no term (a KL in the
        loss, an entropy bonus) reaches it."""
        return (self.objective == "rl" and self.entropy_coef == 0.0
                and not (self.kl_coef > 0.0 and self.kl_mode == "loss"))

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> LossConfig:
        """A config with a preset's settings and ``overrides`` on top."""
        return cls(preset=name, **overrides)

    @property
    def needs_ref_logprobs(self) -> bool:
        """True when reference-policy logprobs must be in the batch (KL term or DPO)."""
        return self.kl_coef > 0.0 or self.objective == "dpo"

    @property
    def needs_values(self) -> bool:
        """True when a critic's values are needed to compute advantages (GAE)."""
        return self.objective == "rl" and self.advantage_estimator == "gae"


__all__ = ["PRESETS", "AdvantageEstimator", "LossAggregation", "LossConfig"]

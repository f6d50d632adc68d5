"""RL, SFT and DPO algorithms as small pure functions over torch tensors.

Modules (each documents its formulas):

- ``config``: ``LossConfig`` and its presets (pydantic; imports no torch)
- ``advantages``: GRPO, Dr. GRPO, RLOO, REINFORCE++(-baseline), GAE, per-turn returns
- ``estimators``: ``compute_advantages(batch, cfg)``, the glue from rewards to token advantages
- ``tree_advantages``: per-turn credit over a branching group's prefix tree (estimator "tree")
- ``policy_loss``: PPO clip (clip-higher, dual clip), GSPO, truncated importance sampling
- ``kl``: k1/k2/k3 estimators, KL as reward penalty
- ``aggregation``: token/sequence/group loss aggregation as per-token weights
- ``value_loss``: PPO's clipped value loss
- ``supervised``: SFT (masked NLL) and DPO
- ``objective``: the loss of one micro-batch under a ``LossConfig``
- ``mismatch``: the rollout/trainer logprob mismatch (``rollout/logprob_max_abs_diff``)
- ``distill``: on-policy distillation's per-token reverse-KL advantages

Import names from their modules (``from palaestra.trainers.algorithms.config import
LossConfig`` does not import torch); this package exports nothing.
"""

from __future__ import annotations

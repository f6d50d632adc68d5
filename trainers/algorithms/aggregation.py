"""Loss aggregation: how per-token losses of a batch become one scalar.

Every mode is linear in the per-token losses, so it is expressed as per-token weights ``w`` with
``loss = sum_t w_t * loss_t``. The weights are computed once over the *whole* batch and then cut
into micro-batches, so gradient accumulation (and data parallelism) gives exactly the gradient of
the full-batch loss whatever the micro-batch split.

With ``m`` the loss mask, ``S`` the sequences that have at least one loss token, ``|y_i|`` the
number of loss tokens of sequence ``i`` and ``G`` the groups with at least one loss token:

- ``token-mean``:               ``w = m / sum(m)`` (DAPO: every token counts the same)
- ``seq-mean-token-sum``:       ``w = m / |S|``
- ``seq-mean-token-mean``:      ``w = m / (|y_i| |S|)`` (GRPO paper, GSPO)
- ``seq-mean-token-sum-norm``:  ``w = m / (L |S|)`` with a constant ``L`` (Dr. GRPO; default:
  the longest ``|y_i|`` in the batch)
- ``group-mean-token-mean``:    ``w = m / (n_g |G|)`` with ``n_g`` the loss tokens of the
  sequence's group ``g`` (each prompt weighs the same, whatever its samples' lengths)
"""

from __future__ import annotations

import torch

from palaestra.errors import ConfigError

AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "group-mean-token-mean",
)


def loss_token_weights(
    mask_BT: torch.Tensor,
    mode: str,
    *,
    group_index_B: torch.Tensor | None = None,
    norm_len: int | None = None,
) -> torch.Tensor:
    """Per-token weights ``w_BT`` such that the aggregated loss is ``(w_BT * loss_BT).sum()``.

    ``mask_BT`` is the (right-padded) loss mask, one row per sequence; ``group_index_B`` gives
    each row's group (needed by ``group-mean-token-mean``).
    """
    m = mask_BT.to(torch.float32)
    tokens_B = m.sum(-1)
    num_seqs = (tokens_B > 0).sum().clamp(min=1).to(torch.float32)
    if mode == "token-mean":
        return m / m.sum().clamp(min=1.0)
    if mode == "seq-mean-token-sum":
        return m / num_seqs
    if mode == "seq-mean-token-mean":
        return m / (tokens_B.clamp(min=1.0)[:, None] * num_seqs)
    if mode == "seq-mean-token-sum-norm":
        length = float(norm_len) if norm_len is not None else float(tokens_B.max().clamp(min=1))
        return m / (length * num_seqs)
    if mode == "group-mean-token-mean":
        if group_index_B is None:
            raise ConfigError(
                "loss_agg='group-mean-token-mean' needs group ids; build the batch from samples "
                "with a group_id (TrainBatch.from_samples) or pick another loss_agg"
            )
        groups = group_index_B.to(torch.long)
        num_groups_total = int(groups.max().item()) + 1 if groups.numel() else 0
        tokens_G = torch.zeros(num_groups_total).index_add_(0, groups, tokens_B)
        num_groups = (tokens_G > 0).sum().clamp(min=1).to(torch.float32)
        return m / (tokens_G[groups].clamp(min=1.0)[:, None] * num_groups)
    raise ConfigError(f"unknown loss aggregation {mode!r}; choose one of {list(AGGREGATIONS)}")


def aggregate_loss(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str,
    *,
    group_index_B: torch.Tensor | None = None,
    norm_len: int | None = None,
) -> torch.Tensor:
    """The scalar loss of ``loss_BT`` under aggregation ``mode`` (see the module docstring)."""
    weights = loss_token_weights(mask_BT, mode, group_index_B=group_index_B, norm_len=norm_len)
    # where(): a non-finite loss at a masked position must not turn the sum into NaN
    return torch.where(weights > 0, weights.to(loss_BT.dtype) * loss_BT, 0.0).sum()


__all__ = ["AGGREGATIONS", "aggregate_loss", "loss_token_weights"]

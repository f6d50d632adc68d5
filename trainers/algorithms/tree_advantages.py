"""Tree advantages: per-turn credit over the prefix tree of a branching group's leaves.

A branching group (`palaestra.rollout.branching`) plays episodes that share their first turns
and fork at branch points, so its leaves form a tree: a *node* is one turn's action of one
branch, and the leaves below a node are the samples whose tokens agree with it up to the end of
that turn. The tree is read off the exact tokens (``Sample.turn_ends`` cut each sample into
turns; two samples of a group are at the same node of turn ``k`` exactly when their tokens agree
up to the end of turn ``k``), so nothing but the samples themselves is needed, and a plain group
of independent episodes is the tree whose every leaf forks at the root.

Values and advantages (``g`` = the group, the root):

- ``V(n)`` = mean reward of the leaves below node ``n``; ``V(root)`` = the group's mean;
- the tokens of turn ``k`` of leaf ``i`` (node ``n_k``) get ``V(n_k) - V(b)``, where ``b`` is the
  nearest ancestor of ``n_k`` (or the root) with more leaves than ``n_k``: the value the branch
  point expected, so turns on a chain without a fork share the credit of the edge they are on;
- ``norm_by_std`` (the group-normalised variant): divided by the group's reward std (+eps),
  GRPO's scale.

So a group without shared prefixes gets exactly GRPO's advantages (every node has one leaf and
its parent is the root), a turn that every leaf of the group shares gets 0, and the advantages of
the turns of a leaf add up, edge by edge, to ``r_i - V(root)`` along its path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from palaestra.errors import TrajectoryValidationError
from palaestra.trainers.algorithms.advantages import turn_spans


def tree_nodes(
    token_ids: Sequence[Sequence[int]],
    turn_ends: Sequence[Sequence[int]],
    group_ids: Sequence[str],
) -> list[list[int]]:
    """Node id of each turn of each sample: equal ids = same group and the same tokens up to
    the end of that turn (a sample with sampled tokens but no turn ends is one turn)."""
    if not len(token_ids) == len(turn_ends) == len(group_ids):
        raise TrajectoryValidationError(
            f"tree_nodes: {len(token_ids)} samples, {len(turn_ends)} turn_ends, "
            f"{len(group_ids)} group ids; give one of each per sample")
    index: dict[tuple[int, str | int, tuple[int, ...]], int] = {}
    roots: dict[str, int] = {}
    out: list[list[int]] = []
    for ids, ends, group in zip(token_ids, turn_ends, group_ids):
        ids = [int(t) for t in ids]
        cuts = [min(int(e), len(ids)) for e in ends] or [len(ids)]
        parent: int = -1 - roots.setdefault(group, len(roots))  # roots: negative ids
        start, path = 0, []
        for end in cuts:
            key = (parent, group, tuple(ids[start:end]))
            parent = index.setdefault(key, len(index))
            path.append(parent)
            start = end
        out.append(path)
    return out


def tree_turn_advantages(
    rewards: Sequence[float],
    nodes: Sequence[Sequence[int]],
    group_ids: Sequence[str],
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> list[list[float]]:
    """Advantage of each turn of each sample (see the module docstring); ``nodes[i][k]`` is the
    node of turn ``k`` of sample ``i`` (`tree_nodes`), unique across groups."""
    if not len(rewards) == len(nodes) == len(group_ids):
        raise TrajectoryValidationError(
            f"tree advantages: {len(rewards)} rewards, {len(nodes)} node paths, "
            f"{len(group_ids)} group ids; give one of each per sample")
    r = [float(x) for x in rewards]
    bad = [i for i, x in enumerate(r) if not math.isfinite(x)]
    if bad:
        raise TrajectoryValidationError(f"tree advantages: samples {bad[:5]} have no finite reward")
    leaf_sum: dict[int, float] = {}
    leaf_count: dict[int, int] = {}
    group_r: dict[str, list[float]] = {}
    for i, (path, g) in enumerate(zip(nodes, group_ids)):
        group_r.setdefault(g, []).append(r[i])
        for n in dict.fromkeys(path):  # a node once per leaf
            leaf_sum[n] = leaf_sum.get(n, 0.0) + r[i]
            leaf_count[n] = leaf_count.get(n, 0) + 1
    stats = {g: _mean_std(v) for g, v in group_r.items()}
    out: list[list[float]] = []
    for path, g in zip(nodes, group_ids):
        root_mean, std = stats[g]
        scale = (std + eps) if norm_by_std else 1.0
        size = len(group_r[g])
        row = []
        for k, n in enumerate(path):
            count = leaf_count[n]
            parent_value = root_mean
            for j in range(k - 1, -1, -1):  # nearest ancestor with more leaves
                a = path[j]
                if leaf_count[a] > count:
                    parent_value = leaf_sum[a] / leaf_count[a]
                    break
            if count >= size:  # every leaf of the group is below it: nothing to compare
                row.append(0.0)
                continue
            row.append((leaf_sum[n] / count - parent_value) / scale)
        out.append(row)
    return out


def tree_token_advantages(
    token_ids: Sequence[torch.Tensor],
    loss_mask: Sequence[torch.Tensor],
    turn_ends: Sequence[Sequence[int]],
    group_ids: Sequence[str],
    rewards: Sequence[float],
    *,
    norm_by_std: bool = True,
) -> list[torch.Tensor]:
    """Per-token tree advantages (ragged, one float tensor per sample; 0 off the loss mask)."""
    ids = [t.tolist() for t in token_ids]
    ends = [list(e) if e else [len(t)] for e, t in zip(turn_ends, ids)]
    nodes = tree_nodes(ids, ends, group_ids)
    per_turn = tree_turn_advantages(rewards, nodes, group_ids, norm_by_std=norm_by_std)
    out = []
    for mask, row_ends, row_adv in zip(loss_mask, ends, per_turn):
        adv = torch.zeros(mask.shape[0], dtype=torch.float32)
        for (start, end), a in zip(turn_spans(row_ends, mask.shape[0]), row_adv):
            adv[start:end] = a
        out.append(adv * mask.to(torch.float32))
    return out


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))  # GRPO's (Bessel)


__all__ = ["tree_nodes", "tree_token_advantages", "tree_turn_advantages"]

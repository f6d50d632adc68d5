"""Tree advantages against hand-computed trees, GRPO on trees without shared prefixes, the
estimator through `compute_advantages`, and the config checks that refuse what it cannot do."""

from __future__ import annotations

import pytest
import torch

from palaestra.config import load_config
from palaestra.errors import ConfigError
from palaestra.trainers.algorithms.config import LossConfig
from palaestra.trainers.algorithms.estimators import compute_advantages
from palaestra.trainers.algorithms.tree_advantages import tree_nodes, tree_turn_advantages
from palaestra.trainers.batching import TrainBatch
from palaestra.types import Sample

torch.set_num_threads(1)


def _sample(prompt: list[int], turns: list[tuple[list[int], list[int]]], reward: float,
            group: str = "g") -> Sample:
    """A sample of ``prompt`` then (sampled, observation) pairs per turn."""
    ids, mask, ends = list(prompt), [0] * len(prompt), []
    for sampled, obs in turns:
        ids += sampled
        mask += [1] * len(sampled)
        ends.append(len(ids))
        ids += obs
        mask += [0] * len(obs)
    n = len(ids)
    return Sample(tuple(ids), tuple(mask), (0.0,) * n, tuple(0 if m else -1 for m in mask),
                  len(prompt), reward=reward, turn_rewards=(0.0,) * (len(turns) - 1) + (reward,),
                  group_id=group, turn_ends=tuple(ends))


def _turn_adv(samples: list[Sample], norm: bool = False) -> list[list[float]]:
    nodes = tree_nodes([s.token_ids_T for s in samples], [s.turn_ends for s in samples],
                       [s.group_id for s in samples])
    return tree_turn_advantages([s.reward for s in samples], nodes,
                                [s.group_id for s in samples], norm_by_std=norm)


def test_two_level_tree_matches_hand_values() -> None:
    # leaves 0,1 share turn 0 (node A), leaves 2,3 share turn 0 (node B); turn 1 forks each
    s = [_sample([1, 2], [([5], [9]), ([7], [])], 1.0),
         _sample([1, 2], [([5], [9]), ([8], [])], 0.0),
         _sample([1, 2], [([6], [9]), ([7], [])], 1.0),
         _sample([1, 2], [([6], [9]), ([8], [])], 1.0)]
    nodes = tree_nodes([x.token_ids_T for x in s], [x.turn_ends for x in s], ["g"] * 4)
    assert nodes[0][0] == nodes[1][0] != nodes[2][0] == nodes[3][0]
    assert len({n[1] for n in nodes}) == 4
    # root 0.75, V(A) 0.5, V(B) 1.0
    expected = [[-0.25, 0.5], [-0.25, -0.5], [0.25, 0.0], [0.25, 0.0]]
    for got, want in zip(_turn_adv(s), expected):
        assert got == pytest.approx(want)


def test_chain_turns_share_their_edge_and_paths_sum_to_reward_minus_root() -> None:
    # leaves 0,1 share turn 0 and fork at turn 1; leaf 2 has its own turn 0; three turns each
    s = [_sample([3], [([5], [9]), ([1], [9]), ([4], [])], 1.0),
         _sample([3], [([5], [9]), ([2], [9]), ([4], [])], 0.0),
         _sample([3], [([6], [9]), ([1], [9]), ([4], [])], 0.0)]
    adv = _turn_adv(s)
    third = 1.0 / 3.0
    assert adv[0] == pytest.approx([0.5 - third, 0.5, 0.5])  # turn 2 is on turn 1's edge
    assert adv[1] == pytest.approx([0.5 - third, -0.5, -0.5])
    assert adv[2] == pytest.approx([-third, -third, -third])
    # walking the compressed edges of a path adds up to r_i - V(root)
    assert adv[0][0] + adv[0][1] == pytest.approx(1.0 - third)


def test_shared_turn_gets_zero_and_groups_are_separate() -> None:
    a = [_sample([1], [([5], [9]), ([7], [])], r, "a") for r in (1.0,)] + \
        [_sample([1], [([5], [9]), ([8], [])], 0.0, "a")]
    b = [_sample([1], [([5], [9]), ([7], [])], 0.0, "b"),
         _sample([1], [([6], [9]), ([7], [])], 0.0, "b")]
    adv = _turn_adv(a + b)
    assert adv[0] == pytest.approx([0.0, 0.5]) and adv[1] == pytest.approx([0.0, -0.5])
    assert adv[2] == adv[3] == [0.0, 0.0]  # same tokens as group a's leaf 0, other group


def test_no_shared_prefix_is_grpo() -> None:
    rewards = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0]
    s = [_sample([1, 2], [([10 + i], [9]), ([20 + i], [])], r, "g" if i < 4 else "h")
         for i, r in enumerate(rewards)]
    batch = TrainBatch.from_samples(s)
    tree = compute_advantages(batch, LossConfig(advantage_estimator="tree"))
    grpo = compute_advantages(batch, LossConfig(advantage_estimator="grpo"))
    for t, g in zip(tree.advantages, grpo.advantages):
        assert torch.allclose(t, g, atol=1e-5)
    assert any(float(t.abs().sum()) > 0 for t in tree.advantages)


def test_compute_advantages_puts_turn_values_on_sampled_tokens_only() -> None:
    s = [_sample([1, 2], [([5, 5], [9, 9]), ([7], [])], 1.0),
         _sample([1, 2], [([5, 5], [9, 9]), ([8], [])], 0.0),
         _sample([1, 2], [([6, 6], [9, 9]), ([7], [])], 1.0),
         _sample([1, 2], [([6, 6], [9, 9]), ([8], [])], 1.0)]
    out = compute_advantages(TrainBatch.from_samples(s),
                             LossConfig(advantage_estimator="tree", norm_adv_by_std=False))
    assert out.advantages[1].tolist() == pytest.approx([0, 0, -0.25, -0.25, 0, 0, -0.5])
    assert out.advantages[2].tolist() == pytest.approx([0, 0, 0.25, 0.25, 0, 0, 0.0])
    # the normalised variant divides by the group's reward std (0.5 here)
    norm = compute_advantages(TrainBatch.from_samples(s), LossConfig(advantage_estimator="tree"))
    assert norm.advantages[1][2].item() == pytest.approx(-0.25 / (0.5 + 1e-6))


def test_tree_refuses_turn_rewards() -> None:
    s = [_sample([1], [([5], [])], 1.0), _sample([1], [([6], [])], 0.0)]
    with pytest.raises(ConfigError, match="use_turn_rewards"):
        compute_advantages(TrainBatch.from_samples(s),
                           LossConfig(advantage_estimator="tree", use_turn_rewards=True))


def test_train_config_refuses_tree_with_turn_rewards() -> None:
    from pathlib import Path

    from palaestra.run.config import TrainConfig

    quickstart = Path(__file__).resolve().parents[2] / "configs" / "quickstart.toml"
    with pytest.raises(ConfigError, match="advantage_estimator = 'tree'"):
        load_config(TrainConfig, quickstart, ["--trainer.loss.advantage_estimator", "tree",
                                              "--trainer.loss.use_turn_rewards", "true"])
    cfg = load_config(TrainConfig, quickstart, ["--trainer.loss.advantage_estimator", "tree"])
    assert cfg.trainer.loss.advantage_estimator == "tree"

"""Trajectories on the wire: a `Trajectory` as the JSON a client posts (`trajectory_to_wire`)
and groups of them as one post (`wire_groups`); `palaestra.rollout.gateway.validation` parses
them back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from palaestra.types import Trajectory


def trajectory_to_wire(traj: Trajectory) -> dict[str, Any]:
    """The JSON form `parse_trajectory` reads back (what `TrajectoryClient` posts)."""
    return {
        "group_id": traj.group_id,
        "env_id": traj.env_id or "external",
        "task_id": traj.task_id,
        "reward": traj.reward,
        "turn_rewards": list(traj.samples[0].turn_rewards) if traj.samples else [],
        "stop_reason": traj.stop_reason.value,
        "error": traj.error,
        "messages": [m.to_dict() for m in traj.messages],
        "metrics": dict(traj.metrics),
        "samples": [
            {"token_ids": list(s.token_ids_T), "loss_mask": list(s.loss_mask_T),
             "logprobs": list(s.logprobs_T), "versions": list(s.versions_T),
             "prompt_len": s.prompt_len, "turn_ends": list(s.turn_ends)}
            for s in traj.samples
        ],
    }


def wire_groups(groups: Sequence[Any]) -> list[dict[str, Any]]:
    """``[{"group_id", "trajectories": [wire, ...]}]`` of `GroupResult`s (``/trajectories/take``)."""
    return [{"group_id": g.group_id,
             "trajectories": [trajectory_to_wire(t) for t in g.trajectories]} for g in groups]


__all__ = ["trajectory_to_wire", "wire_groups"]

"""`WeightPush`: how new weights reach the engines while `RolloutManager.update_weights` holds
generation paused.

The manager pauses (parking in-flight episodes), awaits ``push.push(version)``, records
``version`` as the newest policy version and resumes. The trainer's `EngineSync` gives one per
training backend (`EngineSync.weights_of`: NCCL/gloo broadcast, disk, HTTP tensors or the
embedded engine's tensors); without one the manager uses its own `EngineWeights`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class WeightPush(Protocol):
    """Moves one set of weights to the rollout engines, tagged with a policy version."""

    async def push(self, version: int) -> None:
        """Put the weights on every engine as ``version``; generation is paused meanwhile
        (unless the engine swaps weights between decode steps)."""
        ...


__all__ = ["WeightPush"]

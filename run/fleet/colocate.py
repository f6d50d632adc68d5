"""Colocated phases (``[placement] colocate = true``): trainer and engine time-slice one GPU.

Each sync-mode RL step switches twice (`ColocatedPhases`):

- rollout -> train (`to_train`): the engine frees its KV cache and moves its weights off the
  GPU (`LocalEngine.release_memory`, SGLang's ``/release_memory_occupation``), the trainer brings
  its parameters, gradients and optimizer state back (``onload``);
- train -> rollout (`to_rollout`, around the weight push of the step): the engine takes its
  weights back, the new weights go in, the trainer moves its state to host memory (``offload``),
  the engine reallocates its KV cache.

Memory is measured at the end of each phase and logged with the step (`metrics`):
``memory/rollout_gib`` and ``memory/train_gib`` (GPU memory allocated by this process, and
``*_peak_gib`` within the phase; per rank ``memory/rank{r}/*`` for a trainer group, whose ranks
are other processes), ``memory/offloaded_gib`` (trainer state moved to host memory) and the
embedded engine's own share (``memory/engine_rollout_gib`` / ``memory/engine_train_gib``: its KV
cache and the weights it keeps on the GPU). On CPU the switches run the same way; the trainer's
offload moves nothing and the engine frees its KV cache only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from palaestra.contracts import MemoryReporting, Offloadable
from palaestra.engine import DeviceMemory, MemoryReleasing
from palaestra.trainers.memory import GIB, device_state_bytes, gpu_memory


def engine_device_bytes(engine: object) -> int | None:
    """Device bytes the embedded engine holds (KV cache, weights off the CPU); None for servers.
    On CPU its KV cache (the only part that a release frees there)."""
    return engine.device_bytes() if isinstance(engine, DeviceMemory) else None


class ColocatedPhases:
    """The phase switches of one colocated run (see the module doc)."""

    def __init__(self, engine: object, trainers: Sequence[object | None]) -> None:
        self.engine = engine  # `MemoryReleasing`, or a router whose ``clients`` are
        self.trainers = [t for t in trainers if t is not None]
        self.phase = "train"  # setup leaves everything resident
        self.switches = 0
        self._record: dict[str, float] = {}

    # ------------------------------------------------------------------ engine control
    async def _engine_memory(self, release: bool, tags: Sequence[str] | None = None) -> None:
        """Release or resume the engine's memory: the embedded engine, or every server."""
        targets: list[MemoryReleasing] = [self.engine] if isinstance(
            self.engine, MemoryReleasing) else list(getattr(self.engine, "clients", ()))
        arg = list(tags) if tags else None
        await asyncio.gather(*((t.release_memory(arg) if release else t.resume_memory(arg))
                               for t in targets))

    def _offload(self) -> None:
        moved = 0.0
        for trainer in self.trainers:
            if not isinstance(trainer, Offloadable):
                continue
            before = device_state_bytes(trainer) / GIB
            out = trainer.offload()
            if isinstance(out, list):  # a trainer group: one dict per rank
                moved += sum(r.get("offloaded_gib", 0.0) for r in out)
            else:
                moved += before
        self._record["memory/offloaded_gib"] = moved

    def _onload(self) -> None:
        for trainer in self.trainers:
            if isinstance(trainer, Offloadable):
                trainer.onload()

    # ---------------------------------------------------------------------- measuring
    def _measure(self, phase: str) -> None:
        """Memory at the end of ``phase`` (this process's GPU, each rank of a group, the
        embedded engine's share), then the peak counters reset for the next phase."""
        import torch

        mem = gpu_memory()
        self._record[f"memory/{phase}_gib"] = mem["allocated_gib"]
        self._record[f"memory/{phase}_peak_gib"] = mem["peak_gib"]
        held = engine_device_bytes(self.engine)
        if held is not None:
            self._record[f"memory/engine_{phase}_gib"] = held / GIB
        for trainer in self.trainers[:1]:
            per_rank = trainer.memory() if isinstance(trainer, MemoryReporting) else None
            if isinstance(per_rank, list):
                for rank, m in enumerate(per_rank):
                    self._record[f"memory/rank{rank}/{phase}_gib"] = m["allocated_gib"]
                    self._record[f"memory/rank{rank}/{phase}_peak_gib"] = m["peak_gib"]
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    # ------------------------------------------------------------------------ switches
    async def start(self) -> None:
        """Enter the first rollout phase: the trainer's state to host memory."""
        self._measure("train")
        await asyncio.to_thread(self._offload)
        self.phase = "rollout"

    async def to_train(self) -> None:
        """Rollout -> train: the engine frees its memory, the trainer comes back."""
        start = time.perf_counter()
        self._measure("rollout")
        await self._engine_memory(release=True)
        await asyncio.to_thread(self._onload)
        self.phase = "train"
        self.switches += 1
        self._record["time/to_train_s"] = time.perf_counter() - start

    @asynccontextmanager
    async def to_rollout(self) -> AsyncIterator[None]:
        """Train -> rollout around the step's weight push: the engine's weights back before
        it, then the trainer to host memory and the engine's KV cache back."""
        start = time.perf_counter()
        self._measure("train")
        await self._engine_memory(release=False, tags=("weights",))
        yield
        await asyncio.to_thread(self._offload)
        await self._engine_memory(release=False, tags=("kv_cache",))
        self.phase = "rollout"
        self.switches += 1
        self._record["time/to_rollout_s"] = time.perf_counter() - start

    @asynccontextmanager
    async def resident(self) -> AsyncIterator[None]:
        """The trainer on its device for a while (a checkpoint: FSDP2 collectives need it)."""
        if self.phase != "rollout":
            yield
            return
        await asyncio.to_thread(self._onload)
        try:
            yield
        finally:
            await asyncio.to_thread(self._offload)

    async def stop(self) -> None:
        """After the last step: the trainer back on its device (final export), the engine
        keeps serving (the final evaluation)."""
        if self.phase == "rollout":
            await asyncio.to_thread(self._onload)
            self.phase = "train"

    def metrics(self) -> dict[str, float]:
        return {**self._record, "memory/phase_switches": float(self.switches)}


__all__ = ["ColocatedPhases", "engine_device_bytes"]

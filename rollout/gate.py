"""What a rollout worker holds beside its episodes: the gate in front of its engine
(`GatedEngine`: refuses generations while the worker is paused, counts requests and engine
time) and its use of the process-wide garbage collector (`GcTuning`)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Sequence
from time import perf_counter

from palaestra.engine import Engine, Generation, SamplingParams


class GatedEngine:
    """The worker's view of its engine: refuses new requests while closed, and counts what goes
    through it (requests in flight, their ids for a targeted abort, engine time)."""

    def __init__(self) -> None:
        self.engine: Engine | None = None  # bound by the worker once it has built its engine
        self.open = True
        self.inflight = 0
        self.request_ids: set[str] = set()
        self.engine_s = 0.0
        self._drained: asyncio.Event | None = None

    @property
    def weight_version(self) -> int:
        assert self.engine is not None
        return self.engine.weight_version

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> Generation:
        engine = self.engine
        assert engine is not None, "the worker binds its engine before any episode starts"
        if not self.open:
            return Generation((), (), "abort", weight_version=engine.weight_version)
        self.inflight += 1
        if request_id is not None:
            self.request_ids.add(request_id)
        t = perf_counter()
        try:
            return await engine.generate(
                input_ids, sampling, request_id=request_id, session_id=session_id
            )
        finally:
            self.engine_s += perf_counter() - t
            self.inflight -= 1
            if request_id is not None:
                self.request_ids.discard(request_id)
            if self.inflight == 0 and self._drained is not None:
                self._drained.set()

    async def wait_open(self) -> None:
        """Return once the gate is open again (a parked branch of a tree waits here)."""
        while not self.open:
            await asyncio.sleep(0.01)

    async def drain(self, *, abort: bool) -> None:
        """Close, abort the requests in flight (unless the caller aborted them on the engines
        already) and wait until none is left."""
        self.open = False
        if not self.inflight:
            return
        assert self.engine is not None
        self._drained = asyncio.Event()
        try:
            if abort:
                await self.engine.abort(list(self.request_ids))
            if self.inflight:
                await self._drained.wait()
        finally:
            self._drained = None


class GcTuning:
    """The worker's use of the process-wide cyclic collector, undone by `release`.

    `freeze` moves the long-lived objects (pooled envs and agents, tokenizer, engine) out of the
    collector's sight and, unless the process tuned its GC itself, collects the young generation
    less often: with thousands of live episodes, collections otherwise cost a quarter of the
    worker's CPU (measured: ~0.6 ms of ~2.8 ms per env step). The collector is per process, so
    this cannot be owned by one worker alone: a Ray worker owns its process; in-process workers
    (``cluster="local"``) share the host's, where `release` restores only the threshold this
    object changed and unfreezes only after this object froze (an unfreeze makes objects
    collectable again; it never frees anything that is still referenced).
    """

    def __init__(self) -> None:
        self.frozen_objects = 0  # pooled objects at the last freeze
        self._froze = False
        self._threshold: tuple[int, int, int] | None = None  # the one replaced, to restore

    def freeze(self, pooled: int) -> None:
        gc.freeze()
        self._froze = True
        if gc.get_threshold() == (700, 10, 10):  # CPython's default
            self._threshold = gc.get_threshold()
            gc.set_threshold(10_000, 20, 100)
        self.frozen_objects = pooled

    def release(self) -> None:
        if self._froze:
            gc.unfreeze()
        if self._threshold is not None and gc.get_threshold() == (10_000, 20, 100):
            gc.set_threshold(*self._threshold)
        self._froze, self._threshold, self.frozen_objects = False, None, 0


__all__ = ["GatedEngine", "GcTuning"]

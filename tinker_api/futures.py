"""The Tinker API's futures: every queued operation answers a request id at once, and
``/api/v1/retrieve_future`` long-polls for its result.

A result is a JSON document (the SDK's response type, dumped) or protobuf bytes
(``ForwardBackwardOutput``, ``SampleResponse``); a failure is the SDK's
``RequestFailedResponse`` (``{"error", "category"}``), ``user`` for an `ApiError`, ``server``
otherwise. `retrieve` waits up to a timeout and then answers ``try_again``, so a client polling
a long step is held on the server rather than spinning. Finished results are kept for the
client to fetch (again, if a retrieval is retried), the oldest dropped past ``keep``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass

from palaestra.tinker_api.errors import ApiError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Result:
    """A finished operation: ``proto`` bytes or a ``json`` document."""

    json: Mapping[str, object] | None = None
    proto: bytes | None = None


@dataclass(frozen=True)
class Failure:
    """A failed operation, as the SDK's ``RequestFailedResponse``."""

    error: str
    category: str  # "user" or "server"

    def as_json(self) -> dict[str, object]:
        return {"error": self.error, "category": self.category}


Outcome = Result | Failure


class FutureStore:
    """Request ids to running tasks and their outcomes."""

    def __init__(self, keep: int = 4096) -> None:
        self._keep = keep
        self._pending: dict[str, asyncio.Future[Outcome]] = {}
        self._done: OrderedDict[str, Outcome] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self._counter = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]

    def new_id(self) -> str:
        return f"{self._prefix}-{next(self._counter)}"

    def submit(self, work: Awaitable[Result], request_id: str | None = None) -> str:
        """Run ``work`` in the background; its outcome is kept under the returned id."""
        rid = request_id or self.new_id()
        fut: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut

        async def run() -> None:
            try:
                outcome: Outcome = await work
            except ApiError as exc:
                outcome = Failure(exc.message, "user")
            except Exception as exc:  # reported to the client, logged here
                log.exception("request %s failed", rid)
                outcome = Failure(f"{type(exc).__name__}: {exc}", "server")
            self._finish(rid, outcome)

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return rid

    def _finish(self, rid: str, outcome: Outcome) -> None:
        fut = self._pending.pop(rid, None)
        self._done[rid] = outcome
        while len(self._done) > self._keep:
            self._done.popitem(last=False)
        if fut is not None and not fut.done():
            fut.set_result(outcome)

    def known(self, rid: str) -> bool:
        return rid in self._pending or rid in self._done

    async def retrieve(self, rid: str, timeout: float) -> Outcome | None:
        """The outcome of ``rid``, waiting up to ``timeout`` s (None: still running)."""
        if rid in self._done:
            return self._done[rid]
        fut = self._pending.get(rid)
        if fut is None:
            raise ApiError(f"unknown request_id {rid!r} (never issued, or dropped long ago)",
                           status=404)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            return None

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


__all__ = ["Failure", "FutureStore", "Outcome", "Result"]

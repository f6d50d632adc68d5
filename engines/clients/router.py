"""`Router`: one `Engine` over several, for data-parallel rollouts.

- **Least outstanding requests**: a request goes to the healthy engine with the fewest requests
  in flight from this router (ties round-robin).
- **Sticky sessions**: all turns of one ``session_id`` go to the same engine while it is healthy,
  so its prefix cache serves the conversation so far.
- **Failover**: an `EngineUnavailableError` (connection error, 5xx) marks the engine unhealthy
  and the request is retried from scratch on another engine; sessions move with it.
- **Health checks**: a background task polls ``health()`` of every engine, taking unhealthy
  ones out and putting recovered ones back.
- Engines can be added and removed at runtime; control calls (weights, pause, abort, flush) go
  to every engine. `drain_engine` removes one gracefully: no new requests, those in flight
  finish, and any still running after ``timeout_s`` are cancelled there and retried on another
  engine. `metrics` counts the engines added and removed and the requests each one served.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from palaestra.engine import Engine, EngineUnavailableError, Generation, SamplingParams
from palaestra.errors import EngineError

if TYPE_CHECKING:
    import torch


#: Python 3.11+: a task tells whether it is being cancelled itself (`asyncio.Task.cancelling`)
_CANCELLING = hasattr(asyncio.Task, "cancelling")


@dataclass(eq=False)
class _Member:
    engine: Engine
    name: str
    healthy: bool = True
    outstanding: int = 0
    served: int = 0
    failures: int = 0
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # a drain gave up on it
    # the generate tasks on it, and those a drain cancelled (they move to another engine)
    tasks: set[asyncio.Future[Generation]] = field(default_factory=set)
    drained: set[asyncio.Future[Generation]] = field(default_factory=set)

    def give_up(self) -> None:
        """A drain gave up on this engine: its generate calls move to another engine."""
        self.gone.set()
        for task in self.tasks:
            self.drained.add(task)
            task.cancel()


class Router:
    """Routes requests over engines (see the module docstring)."""

    def __init__(self, engines: Sequence[Engine] = (), *, health_interval_s: float = 5.0,
                 health_timeout_s: float = 5.0, max_sessions: int = 100_000,
                 close_engines: bool = True) -> None:
        self._members: list[_Member] = []
        self._sessions: OrderedDict[str, _Member] = OrderedDict()
        self._where: dict[str, _Member] = {}
        self._rr = itertools.count()
        self._ids = itertools.count()
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.max_sessions = max_sessions
        self.close_engines = close_engines
        self._health_task: asyncio.Task[None] | None = None
        self._version = 0
        self.added = 0  # engines added / removed after construction (``engines/*`` metrics)
        self.removed = 0
        self.retried = 0  # requests moved to another engine by a drain's timeout
        self._served_by_gone: dict[str, int] = {}
        for e in engines:  # one server listed twice (more weight to it) gets a second name
            base = self._default_name(e)
            taken = {m.name for m in self._members}
            name = base if base not in taken else next(
                f"{base}#{k}" for k in itertools.count(2) if f"{base}#{k}" not in taken)
            self.add_engine(e, name)
        self.added = 0

    # ---------------------------------------------------------------------------- members
    def _default_name(self, engine: Engine) -> str:
        return getattr(engine, "url", None) or f"engine-{next(self._ids)}"

    def add_engine(self, engine: Engine, name: str | None = None) -> None:
        name = name or self._default_name(engine)
        if any(m.name == name for m in self._members):
            raise EngineError(f"the router already has an engine {name!r}")
        self._members.append(_Member(engine, name))
        self.added += 1

    def _member(self, engine: Engine | str) -> _Member:
        for m in self._members:
            if m.engine is engine or m.name == engine:
                return m
        raise EngineError(f"no engine {engine!r} in this router "
                          f"(it has: {', '.join(m.name for m in self._members) or 'none'})")

    def remove_engine(self, engine: Engine | str) -> Engine:
        """Stop routing to an engine (requests in flight on it finish); returns it."""
        m = self._member(engine)
        self._members.remove(m)
        for sid in [s for s, mm in self._sessions.items() if mm is m]:
            del self._sessions[sid]
        self.removed += 1
        self._served_by_gone[m.name] = self._served_by_gone.get(m.name, 0) + m.served
        return m.engine

    async def drain_engine(self, engine: Engine | str, timeout_s: float = 60.0,
                           poll_s: float = 0.02) -> dict[str, Any]:
        """Remove an engine gracefully: no new requests go to it at once; the requests in
        flight on it finish, or after ``timeout_s`` are cancelled there and retried on another
        engine. Returns ``{"name", "finished", "retried", "seconds"}``; the engine is not
        closed (the caller owns it)."""
        m = self._member(engine)
        start = loop_time = asyncio.get_running_loop().time()
        in_flight, served = m.outstanding, m.served
        self.remove_engine(m.engine)
        while m.outstanding > 0 and loop_time - start < timeout_s:
            await asyncio.sleep(poll_s)
            loop_time = asyncio.get_running_loop().time()
        left = m.outstanding
        if left:
            m.give_up()  # the generate calls still on it move to another engine
            while m.outstanding > 0:
                await asyncio.sleep(poll_s)
        self._served_by_gone[m.name] += m.served - served
        return {"name": m.name, "in_flight": in_flight, "finished": in_flight - left,
                "retried": left, "seconds": asyncio.get_running_loop().time() - start}

    @property
    def engines(self) -> list[Engine]:
        return [m.engine for m in self._members]

    def status(self) -> list[dict[str, Any]]:
        return [{"name": m.name, "healthy": m.healthy, "outstanding": m.outstanding,
                 "served": m.served, "failures": m.failures,
                 "weight_version": m.engine.weight_version} for m in self._members]

    def metrics(self) -> dict[str, float]:
        """``engines/count``, ``engines/added``, ``engines/removed``, ``engines/retried`` and
        ``engines/requests/<name>`` (requests served, removed engines included)."""
        out: dict[str, float] = {"engines/count": float(len(self._members)),
                                 "engines/added": float(self.added),
                                 "engines/removed": float(self.removed),
                                 "engines/retried": float(self.retried)}
        served = dict(self._served_by_gone)
        for m in self._members:
            served[m.name] = served.get(m.name, 0) + m.served
        out.update({f"engines/requests/{name}": float(n) for name, n in served.items()})
        return out

    def _pick(self, session_id: str | None, exclude: set[int]) -> _Member | None:
        live = [m for m in self._members if m.healthy and id(m) not in exclude]
        if not live:
            return None
        if session_id is not None:
            sticky = self._sessions.get(session_id)
            if sticky is not None and sticky in live:
                self._sessions.move_to_end(session_id)
                return sticky
        low = min(m.outstanding for m in live)
        ties = [m for m in live if m.outstanding == low]
        chosen = ties[next(self._rr) % len(ties)]
        if session_id is not None:
            self._sessions[session_id] = chosen
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return chosen

    def _ensure_health_task(self) -> None:
        if self.health_interval_s <= 0:
            return
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def _check(self, m: _Member) -> None:
        try:
            ok = await asyncio.wait_for(m.engine.health(), self.health_timeout_s)
        except (asyncio.TimeoutError, Exception):
            ok = False
        m.healthy = bool(ok)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._check(m) for m in list(self._members)))
            await asyncio.sleep(self.health_interval_s)

    # --------------------------------------------------------------------------- protocol
    @property
    def weight_version(self) -> int:
        versions = [m.engine.weight_version for m in self._members if m.healthy]
        return min(versions) if versions else self._version

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *,
                       request_id: str | None = None, session_id: str | None = None) -> Generation:
        self._ensure_health_task()
        tried: set[int] = set()
        errors: list[str] = []
        while True:
            m = self._pick(session_id, tried)
            if m is None:
                if not tried:  # everything marked down: look again before giving up
                    await asyncio.gather(*(self._check(x) for x in self._members))
                    m = self._pick(session_id, tried)
                if m is None:
                    raise EngineUnavailableError(
                        "no healthy engine left for the request"
                        + (f"; tried: {'; '.join(errors)}" if errors else
                           f" ({len(self._members)} engines, none healthy)"))
            tried.add(id(m))
            m.outstanding += 1
            if request_id is not None:
                self._where[request_id] = m
            try:
                gen = await self._generate_on(m, input_ids, sampling, request_id, session_id)
                if gen is None:  # drained away from m: retry on another engine
                    self.retried += 1
                    tried.discard(id(m))
                    continue
            except EngineUnavailableError as exc:
                m.healthy = False
                m.failures += 1
                errors.append(f"{m.name}: {exc}")
                continue
            finally:
                m.outstanding -= 1
                if request_id is not None:
                    self._where.pop(request_id, None)
            m.served += 1
            return gen

    async def _generate_on(self, m: _Member, input_ids: Sequence[int], sampling: SamplingParams,
                           request_id: str | None, session_id: str | None) -> Generation | None:
        """``m``'s generation, or None when a drain of ``m`` gave up on it first."""
        task = asyncio.ensure_future(m.engine.generate(
            input_ids, sampling, request_id=request_id, session_id=session_id))
        if _CANCELLING and not m.gone.is_set():
            # the drain cancels the task itself (`_Member.give_up`): no waiter task per request
            m.tasks.add(task)
            try:
                return await task
            except asyncio.CancelledError:
                cancelling = getattr(asyncio.current_task(), "cancelling", None)
                if task not in m.drained or (cancelling is not None and cancelling()):
                    raise  # the caller was cancelled (the request with it)
            finally:
                m.tasks.discard(task)
                m.drained.discard(task)
            if request_id is not None:  # best effort: free the drained engine's slot
                with contextlib.suppress(Exception):
                    await m.engine.abort([request_id])
            return None
        waiter = asyncio.ensure_future(m.gone.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the caller was cancelled: so is the request
            task.cancel()
            raise
        finally:
            waiter.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        if request_id is not None:  # best effort: free the drained engine's slot
            with contextlib.suppress(Exception):
                await m.engine.abort([request_id])
        return None

    async def _broadcast(self, what: str, *args: Any, **kw: Any) -> None:
        members = [m for m in self._members if m.healthy]
        results = await asyncio.gather(*(getattr(m.engine, what)(*args, **kw) for m in members),
                                       return_exceptions=True)
        failed = [(m, r) for m, r in zip(members, results) if isinstance(r, BaseException)]
        for m, r in failed:
            if isinstance(r, EngineUnavailableError):
                m.healthy = False
        if failed:
            raise EngineError(f"{what} failed on {len(failed)} engine(s): "
                              + "; ".join(f"{m.name}: {r}" for m, r in failed))

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor] | None = None, *, path: str | None = None,
                             version: int | None = None) -> None:
        new = self.weight_version + 1 if version is None else version
        await self._broadcast("update_weights", state_dict, path=path, version=new)
        self._version = new

    async def pause(self, mode: str = "in_place") -> None:
        if mode == "in_place":  # the protocol's pause() takes no mode
            await self._broadcast("pause")
        else:
            await self._broadcast("pause", mode)

    async def resume(self) -> None:
        await self._broadcast("resume")

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        if request_ids is None:
            await self._broadcast("abort", None)
            return
        by_member: dict[int, tuple[_Member, list[str]]] = {}
        for rid in request_ids:
            m = self._where.get(rid)
            if m is not None:
                by_member.setdefault(id(m), (m, []))[1].append(rid)
        await asyncio.gather(*(m.engine.abort(rids) for m, rids in by_member.values()))

    async def flush_cache(self) -> None:
        await self._broadcast("flush_cache")

    async def health(self) -> bool:
        await asyncio.gather(*(self._check(m) for m in self._members))
        return any(m.healthy for m in self._members)

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, RuntimeError):
                await self._health_task
        if self.close_engines:
            for m in self._members:
                with contextlib.suppress(Exception):
                    await m.engine.close()


__all__ = ["Router"]

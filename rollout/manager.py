"""`RolloutManager`: what the training loop calls to turn tasks into batches of scored samples.

    manager = RolloutManager(data, WorkerConfig(engine=EngineSpec.http(urls), agent=spec),
                             RolloutConfig(batch_size=64, group_size=4, filters=("nonzero_variance",)))
    async with manager:
        for step in range(steps):
            batch = await manager.generate_batch(step)      # RolloutBatch(samples, trajectories, metrics)
            ...train on batch.samples...
            async with manager.weights_paused(step + 1):       # pause (unless in place), resume
                await push.push(step + 1)                      # the trainer's weights

Batches: the manager draws tasks (requeued ones first), hands each worker groups through one
long-poll call per worker (`RolloutWorker.exchange`), judges every finished group (failure policy,
filters = dynamic sampling), and stops when ``batch_size`` groups are kept or ``max_draw_factor``
is used up. Over-sampling keeps more groups in flight than missing. In sync mode the workers are
paused when a batch is complete (in-flight groups are parked with their tokens and resume after
the weight update: partial rollout); in async mode the next batch is generated while the trainer
works on this one, and `update_weights` parks/resumes around the push. At hand-off every group is
checked against ``max_staleness`` (newest version minus the oldest sampled token's version) and
dropped or requeued.

Canonical order: every group gets an ordinal when first drawn (a requeued group keeps it); a
batch holds its groups in ordinal order, each group's episodes in their index order, whatever
order they finished in. Episode seeds derive from (``seed``, the task's draw seed, episode index),
and a worker derives each request's sampling seed from the episode seed and the request index, so
no sample depends on a shared RNG stream. Exact batches (``exact=True``, what ``palaestra train``
uses in sync mode): no more groups are drawn than are still missing (``over_sampling`` does not
draw ahead), so when a batch is complete nothing is in flight and the batch is the first
``batch_size`` kept groups of the draw order -- a function of the data order, the seeds and the
weights, never of timing (a resumed run draws exactly what an uninterrupted one would). Partial
rollout (parked groups going on from their tokens) and async mode mix weight versions at points
that follow timing; they stay available when ``exact`` is off.

Checkpoints: `state_dict` holds the data position and the tasks not yet trained on (restarted
from their task on load). `checkpoint_state` (what ``palaestra train`` saves) also holds, when
groups are in flight (async mode), those groups whole: the workers park every episode at its next
generation without cutting one (`RolloutWorker.inflight_state`), and a manager that loads it plays
them on from their last completed turn and keeps the finished, not yet trained-on groups
(`palaestra.rollout.inflight`); branching groups restart from their task.

Ledger: every task drawn is, at any time, exactly one of kept, filtered, failed, dropped-stale,
queued, in flight or ready; ``ledger/unaccounted`` in the metrics is always 0 and the per-step
``groups/*`` counters say where this step's tasks went.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field
from time import perf_counter
from typing import TYPE_CHECKING, Any

from palaestra.errors import CheckpointError, ConfigError, EngineError, RolloutError
from palaestra.rollout.groups import Branching
from palaestra.rollout.cluster import WorkerClient, WorkerPool
from palaestra.rollout.config import RolloutConfig, WorkerConfig
from palaestra.rollout.data import DataSource, _mix
from palaestra.engine import Engine, UpdatesInPlace
from palaestra.rollout.groups import judge_group, resolve_filters
from palaestra.rollout.metrics import summarize
from palaestra.rollout.groups import GroupResult, GroupTask
from palaestra.types import Sample, Trajectory

if TYPE_CHECKING:
    from typing_extensions import Self


@dataclass
class RolloutBatch:
    """One step's training data: kept samples, their trajectories, failures and metrics."""

    step: int
    samples: list[Sample]
    trajectories: list[Trajectory]  # the kept trajectories (one per sample)
    metrics: dict[str, float]
    version: int  # the policy version the batch is checked against (staleness)
    failed: list[Trajectory] = field(default_factory=list)  # failed episodes of the step

    @property
    def group_ids(self) -> list[str]:
        return list(dict.fromkeys(s.group_id for s in self.samples))


@dataclass
class _Ready:
    task: GroupTask
    usable: tuple[Trajectory, ...]
    ordinal: int = 0  # draw order of the group (the canonical batch order)
    min_version: int = -1  # oldest policy version of any sampled token; -1: none sampled

    def __post_init__(self) -> None:
        versions = [s.min_version for t in self.usable for s in t.samples if s.num_sampled]
        self.min_version = min(versions, default=-1)


class _Step:
    """What happened since the last batch was handed off."""

    def __init__(self) -> None:
        self.began = perf_counter()
        self.counters: Counter[str] = Counter()
        self.finished: list[Trajectory] = []


class RolloutManager:
    """Turns a data source into `RolloutBatch`es through rollout workers; see the module doc."""

    def __init__(
        self,
        data: DataSource,
        worker_config: WorkerConfig,
        config: RolloutConfig | None = None,
        *,
        cluster: str | None = None,
        address: str | None = None,
        engine: Engine | None = None,
        pool: WorkerPool | None = None,
        seed: int = 0,
        exact: bool = False,
    ) -> None:
        self.data = data
        self.worker_config = worker_config
        self.config = config or RolloutConfig()
        self.config.check()  # a config built by model_validate/model_copy skipped its __init__
        if exact and self.config.mode != "sync":
            raise ConfigError(
                "exact batches need mode='sync': in async mode batch k+1 is sampled while step k "
                "trains, so which tokens see which weights follows timing"
            )
        self.seed = int(seed)
        self.exact = exact
        self._engine = engine
        self._filters = resolve_filters(self.config.filters)
        self._control: Engine | None = engine
        self._own_pool = pool is None
        self.pool = pool or WorkerPool(
            worker_config,
            self.config.num_workers,
            cluster=cluster or self.config.cluster,  # the arguments win over the config's
            address=address or self.config.ray_address,
            num_cpus=self.config.worker_num_cpus,
            engine=engine,
            start_timeout_s=self.config.start_timeout_s,
        )
        self._started = False
        self._polls: dict[int, asyncio.Future[list[GroupResult]]] = {}
        self._queue: deque[GroupTask] = deque()
        self._inflight: dict[str, tuple[int, GroupTask]] = {}
        self._ready: list[_Ready] = []
        self._totals: Counter[str] = Counter()
        self._step = _Step()
        self._prefetch: asyncio.Task[bool] | None = None
        self._paused = False
        self._seq = 0
        self._ordinal: dict[str, int] = {}  # group id -> draw order
        self._restore: list[Any] = []  # saved in-flight groups of a checkpoint (load_state_dict)
        self.version = 0

    # ----- lifecycle ---------------------------------------------------------------------------
    @property
    def _handles(self) -> list[WorkerClient]:
        return self.pool.handles

    async def start(self) -> None:
        """Start (or, for a shared pool, reconfigure) the workers and the engine control client."""
        if self._started:
            return
        self._started = True
        if self._own_pool:
            await self.pool.start()
        else:
            await self.pool.start()
            await self.pool.configure(self.worker_config)
        if self._control is None and not self.worker_config.engine.owned:
            self._control = self.worker_config.engine.build()
        if self._control is not None:
            # engines keep a pause across clients (an earlier run may have left them paused)
            await self._on_engines("resume", lambda e: e.resume())
            self.version = self._control.weight_version
        if self._restore:  # in-flight groups of a checkpoint: on from their last turns
            await self._restore_inflight()

    async def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.cancel()
            await asyncio.gather(self._prefetch, return_exceptions=True)
            self._prefetch = None
        for fut in self._polls.values():
            fut.cancel()
        self._polls.clear()
        if self._paused and self._control is not None:  # leave shared engines running
            await self._on_engines("resume", lambda e: e.resume())
        self._paused = False
        if self._own_pool:
            await self.pool.close()
        elif self._handles:  # a shared pool: stop this run's episodes, keep the processes
            await asyncio.gather(*(h.shutdown() for h in self._handles))
        self._started = False
        if self._control is not None and self._engine is None:
            await self._control.close()
            self._control = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ----- batches -----------------------------------------------------------------------------
    async def generate_batch(self, step: int) -> RolloutBatch:
        """The next batch: ``batch_size`` kept groups (fewer only when the draw cap is hit)."""
        await self.start()
        if self._restore:  # loaded after start()
            await self._restore_inflight()
        if self._paused:
            await self.resume()
        cfg = self.config
        while True:
            if self._prefetch is not None:
                prefetch, self._prefetch = self._prefetch, None
                full = await prefetch
            else:
                full = await self._fill()
            self._prune_stale()
            if len(self._ready) >= cfg.batch_size or not full:
                break
        self._ready.sort(key=lambda r: r.ordinal)  # oldest draws first, whatever finished first
        chosen, self._ready = self._ready[: cfg.batch_size], self._ready[cfg.batch_size :]
        if not chosen:
            raise RolloutError(
                f"step {step}: no group could be kept ({self._describe_losses()}); check the "
                "filters, the data source (exhausted?) and the failures above"
            )
        self._check_failures(final=True)
        if cfg.pauses_between_batches:
            await self.pause()
        batch = self._hand_off(step, chosen)
        if cfg.mode == "async":
            self._prefetch = asyncio.get_running_loop().create_task(self._fill())
        return batch

    def _hand_off(self, step: int, chosen: list[_Ready]) -> RolloutBatch:
        cfg, st = self.config, self._step
        self._totals["kept"] += len(chosen)
        trajectories = [t for r in chosen for t in r.usable]
        samples = [s for t in trajectories for s in t.samples]
        c = st.counters
        for key in ("groups/parked", "episodes/parked", "episodes/resumed"):
            c[key] += 0  # always there: a resumed run's first step has not paused yet
        c["groups/kept"] = len(chosen)
        c["groups/ready_carried"] = len(self._ready)
        c["groups/in_flight"] = len(self._inflight)
        c["groups/queued"] = len(self._queue)
        c["batch/underfilled"] = int(len(chosen) < cfg.batch_size)
        c["version"] = self.version
        staleness = [self.version - r.min_version for r in chosen if r.min_version >= 0]
        # completion order is timing: sort (stable, so a group's episodes keep their index order)
        st.finished.sort(key=lambda t: self._ordinal.get(t.group_id, 0))
        metrics = summarize(
            st.finished, trajectories, c, perf_counter() - st.began,
            pass_threshold=cfg.pass_threshold,
        )
        if self.worker_config.rewards is not None:  # reward/<name>: each [[rewards]] part
            from palaestra.rollout.rewards.scoring import part_metrics

            metrics.update(part_metrics(trajectories))
        metrics["staleness/max"] = float(max(staleness, default=0))
        metrics["staleness/mean"] = sum(staleness) / max(len(staleness), 1)
        for key, value in self._ledger().items():
            metrics[f"ledger/{key}"] = float(value)
        failed = [t for t in st.finished if t.failed]
        self._step = _Step()
        live = {t.group_id for t in self._queue} | set(self._inflight)
        live |= {r.task.group_id for r in self._ready}
        self._ordinal = {g: o for g, o in self._ordinal.items() if g in live}
        return RolloutBatch(step, samples, trajectories, metrics, self.version, failed)

    async def _fill(self) -> bool:
        """Run workers until ``batch_size`` groups are ready; False if no more can come."""
        cfg = self.config
        while len(self._ready) < cfg.batch_size:
            self._check_failures(final=False)
            missing = cfg.batch_size - len(self._ready)
            # exact batches never draw ahead: what is drawn then does not follow timing
            ahead = 1.0 if self.exact else cfg.over_sampling
            target = min(cfg.max_inflight_groups, math.ceil(missing * ahead))
            share = math.ceil(target / max(len(self._handles), 1))  # spread over the workers
            loaded = Counter(w for w, _ in self._inflight.values())
            for h in self._handles:
                if h.index not in self._polls:
                    room = min(target - len(self._inflight), share - loaded[h.index])
                    new = self._draw(h.index, room)
                    self._polls[h.index] = asyncio.ensure_future(h.exchange(new))
            if not self._inflight and not self._can_draw():
                return False
            done, _ = await asyncio.wait(
                list(self._polls.values()), return_when=asyncio.FIRST_COMPLETED
            )
            for index, fut in list(self._polls.items()):
                if fut in done:
                    del self._polls[index]
                    self._absorb(index, fut)
        return True

    def _can_draw(self) -> bool:
        st = self._step.counters
        if st["groups/drawn"] + st["groups/redrawn"] >= self.config.max_draws:
            return False
        return bool(self._queue) or not self.data.exhausted

    def _draw(self, worker: int, count: int) -> list[GroupTask]:
        out: list[GroupTask] = []
        c = self._step.counters
        while len(out) < count and self._can_draw():
            if self._queue:
                task = self._queue.popleft()
                c["groups/redrawn"] += 1
            else:
                item = self.data.next()
                if item is None:
                    break
                self._seq += 1
                n = self.config.group_size
                tree = self.config.branching
                branching = tree.spec() if tree is not None else None
                base = _mix(self.seed, item.seed, 2)  # the run's seed, then the draw's
                task = GroupTask(
                    group_id=f"g{self._seq}",
                    env_id=item.env_id,
                    task=dict(item.task),
                    task_id=item.task_id,
                    seeds=tuple(_mix(base, i, 1) for i in range(n)),
                    branching=branching,
                )
                self._ordinal[task.group_id] = self._seq
                c["groups/drawn"] += 1
                self._totals["drawn"] += 1
            self._inflight[task.group_id] = (worker, task)
            out.append(task)
        return out

    def _absorb(self, worker: int, fut: asyncio.Future[list[GroupResult]]) -> None:
        try:
            results = fut.result()
        except Exception as exc:  # noqa: BLE001 -- a dead worker (RayActorError and kin)
            self._lose_worker(worker, exc)
            return
        c = self._step.counters
        for result in results:
            _, task = self._inflight.pop(result.group_id)
            self._step.finished.extend(result.trajectories)
            verdict = judge_group(
                result.trajectories, self._filters, min_group_size=self.config.min_group_size
            )
            if verdict.status == "failed":
                self._totals["failed"] += 1
                c["groups/failed"] += 1
            elif verdict.status == "filtered":
                self._totals["filtered"] += 1
                c["groups/filtered"] += 1
                c[f"groups/filtered/{verdict.reason}"] += 1
            else:
                ordinal = self._ordinal.get(task.group_id, 0)
                self._ready.append(_Ready(task, verdict.usable, ordinal))
        self._prune_stale()

    def _prune_stale(self) -> None:
        fresh = []
        c = self._step.counters
        for ready in self._ready:
            # a group with no sampled token (every prompt truncated) has no policy to be
            # stale against: requeued, it would come back the same, at every step
            if ready.min_version < 0 or \
                    self.version - ready.min_version <= self.config.max_staleness:
                fresh.append(ready)
            elif self.config.stale_action == "drop":
                self._totals["stale_dropped"] += 1
                c["groups/stale_dropped"] += 1
            else:
                self._queue.append(ready.task)
                c["groups/stale_requeued"] += 1
        self._ready = fresh

    def _lose_worker(self, worker: int, exc: BaseException) -> None:
        """A worker died: requeue its groups and go on with the others."""
        self.pool.drop(worker)
        lost = [gid for gid, (w, _) in self._inflight.items() if w == worker]
        for gid in lost:
            self._queue.append(self._inflight.pop(gid)[1])
        self._step.counters["groups/requeued_lost_worker"] += len(lost)
        self._step.counters["workers/lost"] += 1
        if not self._handles:
            raise RolloutError(f"every rollout worker died; the last error: {exc!r}") from exc

    def _check_failures(self, *, final: bool) -> None:
        finished = self._step.finished
        minimum = 1 if final else self.config.batch_size * self.config.group_size
        if len(finished) < minimum:
            return
        failed = [t for t in finished if t.failed]
        rate = len(failed) / len(finished)
        if rate > self.config.max_failure_rate:
            common = Counter((t.error or t.stop_reason.value)[:160] for t in failed).most_common(3)
            lines = "\n".join(f"  {n} x {err}" for err, n in common)
            raise RolloutError(
                f"{len(failed)} of {len(finished)} episodes failed ({rate:.0%} > "
                f"max_failure_rate={self.config.max_failure_rate:.0%}); most common errors:\n"
                f"{lines}\nfix the env/engine or raise max_failure_rate"
            )

    def _ledger(self) -> dict[str, int]:
        t = self._totals
        placed = {
            "kept": t["kept"],
            "filtered": t["filtered"],
            "failed": t["failed"],
            "stale_dropped": t["stale_dropped"],
            "queued": len(self._queue),
            "in_flight": len(self._inflight),
            "ready": len(self._ready),
        }
        return {"drawn": t["drawn"], **placed, "unaccounted": t["drawn"] - sum(placed.values())}

    def _describe_losses(self) -> str:
        c = self._step.counters
        return ", ".join(f"{k}={v}" for k, v in sorted(c.items()) if k.startswith("groups/"))

    # ----- weights -----------------------------------------------------------------------------
    async def pause(self) -> None:
        """Stop all generation: in-flight episodes are parked with their tokens."""
        if self._paused or not self._handles:
            return
        self._paused = True
        if self._control is not None:  # shared engines: one abort-all instead of one per request
            await asyncio.gather(*(h.close_gate() for h in self._handles))
            # abort while the engines still run: SGLang finishes an aborted running request on
            # its next decode step, which a paused scheduler never takes; abort once more after
            # the pause for a request that was on the wire during the first one
            await self._on_engines("abort", lambda e: e.abort())
            await self._on_engines("pause", lambda e: e.pause())
            await self._on_engines("abort", lambda e: e.abort())
        reports = await asyncio.gather(
            *(h.pause(abort=self._control is None) for h in self._handles)
        )
        self._step.counters["groups/parked"] += sum(r.parked_groups for r in reports)
        self._step.counters["episodes/parked"] += sum(r.parked_episodes for r in reports)

    async def resume(self) -> None:
        """Continue generation; parked episodes go on from their tokens."""
        if self._control is not None:
            await self._on_engines("resume", lambda e: e.resume())
        restarted = await asyncio.gather(*(h.resume() for h in self._handles))
        self._step.counters["episodes/resumed"] += sum(restarted)
        self._paused = False

    @contextlib.asynccontextmanager
    async def weights_paused(self, version: int | None = None
                             ) -> AsyncIterator[dict[str, float]]:
        """Generation paused while the caller pushes new weights (in-flight episodes parked),
        then ``version`` (default: the next) recorded as the newest policy version and
        generation resumed. An engine that swaps weights between two decode steps
        (`palaestra.engine.UpdatesInPlace`) is not paused: in-flight episodes go on and record
        the version change in their tokens' spans. Yields the time of each phase
        (``pause_s`` at once, ``push_s`` and ``resume_s`` when the block ends)."""
        await self.start()
        new_version = self.version + 1 if version is None else int(version)
        times: dict[str, float] = {}
        t0 = perf_counter()
        in_place = not self._paused and isinstance(self._control, UpdatesInPlace) \
            and self._control.updates_in_place
        if not in_place:
            await self.pause()
        t1 = perf_counter()
        times["pause_s"] = t1 - t0
        yield times
        self.version = new_version
        t2 = perf_counter()
        if not in_place:
            await self.resume()
        times.update(push_s=t2 - t1, resume_s=perf_counter() - t2)

    async def update_weights(
        self,
        state_dict: Mapping[str, Any] | None = None,
        *,
        path: str | None = None,
        version: int | None = None,
    ) -> dict[str, float]:
        """Pause generation, send ``state_dict`` or the checkpoint at ``path`` (or, with
        neither, only the new version tag) to the engines, resume; returns the time of each
        phase. Shared engines get it through the manager's control client, owned engines
        through their workers. A trainer's weights go by its own push inside
        `weights_paused`."""
        await self.start()
        new_version = self.version + 1 if version is None else int(version)
        async with self.weights_paused(new_version) as times:
            if self._control is not None:
                await self._on_engines("update_weights", lambda e: e.update_weights(
                    state_dict, path=path, version=new_version))
            else:
                await asyncio.gather(*(h.update_weights(new_version, state_dict, path)
                                       for h in self._handles))
        return times

    async def _on_engines(self, what: str, call: Callable[[Engine], Awaitable[None]]) -> None:
        """A control call on the shared engines; a dead engine is counted, not fatal, as long as
        one engine still answers (the router has taken the dead one out of rotation)."""
        assert self._control is not None
        try:
            await call(self._control)
        except EngineError as exc:
            self._step.counters[f"engines/{what}_errors"] += 1
            if not await self._control.health():
                raise RolloutError(f"no engine answers any more ({what}: {exc})") from exc

    # ----- checkpoints -------------------------------------------------------------------------
    async def checkpoint_state(self) -> dict[str, Any]:
        """`state_dict` with the groups in flight saved whole (async mode, where episodes run
        across a checkpoint): the workers' gates close, running generations finish (none is
        cut), every episode parks at its next generation, the workers hand over their groups
        (`RolloutWorker.inflight_state`: tokens, logprobs, versions, env snapshot) and go on.
        With nothing in flight (sync mode's exact batches) it is `state_dict()`."""
        if not (self._handles and self._inflight):
            return self.state_dict()
        handles = list(self._handles)
        await asyncio.gather(*(h.close_gate() for h in handles))
        try:
            await asyncio.gather(*(h.pause(abort=False) for h in handles))
            saved = await asyncio.gather(*(h.inflight_state() for h in handles))
            for index, fut in list(self._polls.items()):  # results already back: absorb them
                if fut.done():
                    del self._polls[index]
                    self._absorb(index, fut)
            return self.state_dict(inflight=[g for part in saved for g in part])
        finally:
            if not self._paused:
                await asyncio.gather(*(h.resume() for h in handles))

    def state_dict(self, inflight: list[Any] | None = None) -> dict[str, Any]:
        """Data position, version and the tasks not yet trained on (restarted on load); with
        ``inflight`` (`checkpoint_state`: the workers' saved groups) those groups, and the ready
        ones, are saved whole under ``"inflight"`` and go on from where they were on load."""
        saved = {g.task.group_id: g for g in inflight or () if g.task.group_id in self._inflight}
        pending = [*self._queue, *(t for g, (_, t) in self._inflight.items() if g not in saved)]
        if inflight is None:
            pending += [r.task for r in self._ready]
        pending.sort(key=lambda t: self._ordinal.get(t.group_id, 0))  # restarted in draw order
        state = {
            "data": self.data.state_dict(),
            "version": self.version,
            "seq": self._seq,
            "pending": [asdict(t) for t in pending],
            "ordinals": [self._ordinal.get(t.group_id, 0) for t in pending],
            "totals": dict(self._totals),  # the ledger goes on where it stopped
        }
        if inflight is not None:
            from palaestra.rollout.inflight import encode_inflight

            ready = [(r.task, r.usable) for r in self._ready]
            ordinals = {g: self._ordinal.get(g, 0)
                        for g in [*saved, *(r.task.group_id for r in self._ready)]}
            state["inflight"] = encode_inflight(list(saved.values()), ready, ordinals)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self._inflight or self._ready:
            raise CheckpointError("load_state_dict must be called before the first batch")
        self.data.load_state_dict(state["data"])
        self.version = int(state["version"])
        self._seq = int(state["seq"])
        tasks = [GroupTask(**{**d, "seeds": tuple(d["seeds"]),
                              "branching": _branching(d.get("branching"))})
                 for d in state["pending"]]
        ordinals = state.get("ordinals") or range(len(tasks))
        self._ordinal.update((t.group_id, int(o)) for t, o in zip(tasks, ordinals))
        self._queue = deque(tasks)
        if state.get("inflight"):
            from palaestra.rollout.inflight import decode_inflight

            groups, ready, saved_ordinals = decode_inflight(state["inflight"])
            self._ordinal.update(saved_ordinals)
            self._restore = groups
            self._ready = [_Ready(task, usable, saved_ordinals.get(task.group_id, 0))
                           for task, usable in ready]
        if "totals" in state:  # the pending tasks are part of its "drawn"
            self._totals = Counter({k: int(v) for k, v in state["totals"].items()})
        else:
            self._totals["drawn"] += len(tasks)

    async def _restore_inflight(self) -> None:
        """Hand the saved groups of `load_state_dict` to the workers (round robin) and play
        them on from their last completed turns."""
        groups, self._restore = self._restore, []
        handles = list(self._handles)
        parts: dict[int, list[Any]] = {h.index: [] for h in handles}
        for i, group in enumerate(groups):
            h = handles[i % len(handles)]
            parts[h.index].append(group)
            self._inflight[group.task.group_id] = (h.index, group.task)
        restored = await asyncio.gather(*(h.restore_inflight(parts[h.index]) for h in handles))
        await asyncio.gather(*(h.resume() for h in handles))
        self._step.counters["episodes/restored"] += sum(restored)
        self._step.counters["groups/restored"] += len(groups)

    # ----- engines joining and leaving (elastic) --------------------------------------------
    async def set_engine_urls(self, urls: list[str], drain_timeout_s: float = 60.0
                              ) -> dict[str, float]:
        """Shared engine servers joined or left the run: the workers (and workers started
        later) route over ``urls``, removed ones drained out of every worker's router, and the
        manager's control client pauses and resumes the new set. Returns the drained requests
        (``finished``, ``retried``) summed over the workers. For workers that share one live
        engine object (``cluster="local"``) its router is the one to change, not this."""
        from dataclasses import replace

        from palaestra.engines.clients.router import Router
        from palaestra.engines.clients.sglang_client import SGLangClient

        spec = self.worker_config.engine
        if spec.owned or not spec.urls:
            raise ConfigError("set_engine_urls needs workers that reach shared engine servers "
                              "(EngineSpec.http)")
        self.worker_config = replace(self.worker_config, engine=replace(spec, urls=tuple(urls)))
        control = self._control
        if isinstance(control, Router) and self._engine is None:
            kwargs = {k: v for k, v in spec.client_kwargs.items() if k != "router"}
            have = [m["name"] for m in control.status()]
            for url in urls:
                if url not in have:
                    control.add_engine(SGLangClient(url, **kwargs))
            for name in have:
                if name not in urls:
                    with contextlib.suppress(EngineError):
                        await control.remove_engine(name).close()
        return await self.pool.set_engine_urls(urls, drain_timeout_s)

    async def engine_metrics(self) -> dict[str, float]:
        """The workers' routers' ``engines/requests/<url>`` and ``engines/retried``, summed
        (the requests each engine served for this run's Ray workers)."""
        out: dict[str, float] = {}
        for stats in await asyncio.gather(*(h.stats() for h in self._handles),
                                          return_exceptions=True):
            if isinstance(stats, dict):
                for key, value in stats.get("engine_metrics", {}).items():
                    if key.startswith("engines/requests/") or key == "engines/retried":
                        out[key] = out.get(key, 0.0) + float(value)
        return out

    async def worker_stats(self) -> list[dict[str, Any]]:
        """Per worker: episodes played, engine time, CPU time, pools, tool cache, engine health."""
        return list(await asyncio.gather(*(h.stats() for h in self._handles)))

    @property
    def exhausted(self) -> bool:
        """True once the data source is drawn out and no task is queued, running or ready."""
        return self.data.exhausted and not (self._queue or self._inflight or self._ready)


def _branching(saved: Any) -> Branching | None:
    """A saved task's branching (`asdict` made it a dict)."""
    if saved is None or isinstance(saved, Branching):
        return saved
    return Branching(tuple(saved["turns"]), int(saved["width"]))


__all__ = ["RolloutBatch", "RolloutManager"]

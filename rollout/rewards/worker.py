"""`RewardWorker`: scores finished episodes with the ``[[rewards]]`` sources, batched across
episodes; `RewardClient`: how a rollout worker reaches it.

Rollout workers call ``client.score_trajectory(traj)`` as each episode finishes (the episode's
task awaits it; the others keep generating), so scoring overlaps rollout. The worker gathers the
episodes that arrive within ``linger_s`` (up to ``max_batch``) and gives each source one call for
all of them; a call that raises or outlasts ``timeout_s`` is retried ``retries`` times (with
backoff), and a conversation that fails on its own (a judge reply without a score, a classifier
input over ``max_length``) is retried alone. An episode that still has no score fails with the
reason, which reaches ``failures.jsonl`` like any failed episode; the other episodes of the
batch stand.

Placement: ``inline`` builds the worker where the client is used (one shared instance for
in-process rollout workers; a copy per Ray worker process otherwise), ``actor`` runs it as one Ray
actor (its own CPUs/GPU) that every rollout worker sends to.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from typing import Any

from palaestra.rollout.rewards.config import (
    RewardError,
    RewardSourceConfig,
    RewardWorkerSection,
)
from palaestra.rollout.rewards.render import Conversation, turn_prefixes
from palaestra.rollout.rewards.scoring import (
    Part,
    ScoreRequest,
    ScoreResult,
    apply_score,
    combine,
)
from palaestra.types import Trajectory


class RewardWorker:
    """Batches score requests over the sources (see the module docstring)."""

    def __init__(self, sources: Sequence[Mapping[str, Any] | RewardSourceConfig],
                 settings: Mapping[str, Any] | RewardWorkerSection | None = None) -> None:
        from palaestra.rollout.rewards.sources import build_source

        self.configs = [s if isinstance(s, RewardSourceConfig)
                        else RewardSourceConfig.model_validate(dict(s)) for s in sources]
        self.settings = (settings if isinstance(settings, RewardWorkerSection)
                         else RewardWorkerSection.model_validate(dict(settings or {})))
        self.sources = [build_source(c) for c in self.configs]
        self._pending: list[tuple[ScoreRequest, asyncio.Future[ScoreResult]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._batches: set[asyncio.Task[None]] = set()
        self.stats = {"episodes": 0, "batches": 0, "retries": 0, "failed": 0}

    async def score(self, request: ScoreRequest) -> ScoreResult:
        """The score of one episode (batched with the others that arrive meanwhile)."""
        fut: asyncio.Future[ScoreResult] = asyncio.get_running_loop().create_future()
        self._pending.append((request, fut))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())
        return await fut

    async def score_many(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        return list(await asyncio.gather(*(self.score(r) for r in requests)))

    async def _flush(self) -> None:
        s = self.settings
        while self._pending:
            if s.linger_s > 0 and len(self._pending) < s.max_batch:
                await asyncio.sleep(s.linger_s)
            batch, self._pending = self._pending[:s.max_batch], self._pending[s.max_batch:]
            task = asyncio.get_running_loop().create_task(self._run_batch(batch))
            self._batches.add(task)
            task.add_done_callback(self._batches.discard)

    async def _run_batch(self, batch: list[tuple[ScoreRequest, asyncio.Future[ScoreResult]]]) -> None:
        try:
            results = await self._score_batch([r for r, _ in batch])
        except Exception as exc:  # noqa: BLE001 -- a bug of ours must not hang the episodes
            results = [ScoreResult(error=f"{type(exc).__name__}: {exc}")] * len(batch)
        self.stats["batches"] += 1
        self.stats["episodes"] += len(batch)
        self.stats["failed"] += sum(r.error is not None for r in results)
        for (_, fut), result in zip(batch, results):
            if not fut.done():
                fut.set_result(result)

    async def _score_batch(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        parts: list[list[Part]] = [[] for _ in requests]
        errors: list[str | None] = [None] * len(requests)
        for source in self.sources:
            if source.cfg.kind == "env":
                for i, r in enumerate(requests):
                    values = r.env_turn_rewards if source.per == "turn" else (r.env_reward,)
                    parts[i].append(Part(source.name, source.weight, source.per, values))
                continue
            owners: list[int] = []
            conversations: list[Conversation] = []
            for i, r in enumerate(requests):
                convs = (turn_prefixes(r.messages, r.turns) if source.per == "turn"
                         else [list(r.messages)])
                owners += [i] * len(convs)
                conversations += convs
            scores = await self._call(source, conversations)
            by_owner: dict[int, list[float]] = {}
            for i, value in zip(owners, scores):
                if isinstance(value, BaseException):
                    errors[i] = errors[i] or f"{source.name}: {_describe(value)}"
                else:
                    by_owner.setdefault(i, []).append(value)
            for i in range(len(requests)):
                if errors[i] is None:
                    values = tuple(by_owner.get(i, ()))
                    parts[i].append(Part(source.name, source.weight, source.per, values))
        return [ScoreResult(error=err) if err is not None else combine(p, r.turns)
                for p, err, r in zip(parts, errors, requests)]

    async def _call(self, source: Any, conversations: list[Conversation]) -> list[float | BaseException]:
        """``source.score`` with a timeout, retrying what failed (the whole call or single items)."""
        s = self.settings
        results: list[float | BaseException] = [RewardError("not scored")] * len(conversations)
        todo = list(range(len(conversations)))
        for attempt in range(s.retries + 1):
            if not todo:
                break
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(s.retry_backoff_s * 2 ** (attempt - 1))
            try:
                out = await asyncio.wait_for(source.score([conversations[i] for i in todo]),
                                             s.timeout_s)
            except (asyncio.TimeoutError, TimeoutError):
                out = [RewardError(f"timed out after {s.timeout_s} s")] * len(todo)
            except Exception as exc:  # noqa: BLE001 -- an engine that died, a bad checkpoint
                out = [exc] * len(todo)
            retry = []
            for i, value in zip(todo, out):
                if not isinstance(value, BaseException) and not math.isfinite(float(value)):
                    value = RewardError(f"the score is not finite ({value})")
                results[i] = value if isinstance(value, BaseException) else float(value)
                if isinstance(value, BaseException):
                    retry.append(i)
            todo = retry
        attempts = s.retries + 1
        return [RewardError(f"{_describe(v)} (after {attempts} attempt{'s' * (attempts > 1)})")
                if isinstance(v, BaseException) else v for v in results]

    async def ping(self) -> dict[str, int]:
        return dict(self.stats)

    async def close(self) -> None:
        for task in list(self._batches):
            task.cancel()
        for source in self.sources:
            await source.close()


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, RewardError) else f"{type(exc).__name__}: {exc}"


class RewardClient:
    """A rollout worker's handle on the reward worker: in process or a Ray actor (picklable).

    The actor is named after this client and created by its first user (``get_if_exists``), so
    every rollout worker process that unpickles the client reaches the same actor.
    """

    def __init__(self, sources: Sequence[RewardSourceConfig],
                 settings: RewardWorkerSection | None = None, *, placement: str = "inline") -> None:
        import uuid

        self.sources = [s.model_dump() for s in sources]
        self.settings = (settings or RewardWorkerSection()).model_dump()
        self.placement = placement
        self.actor_name = f"palaestra-rewards-{uuid.uuid4().hex[:12]}"
        self._actor: Any = None
        self._local: RewardWorker | None = None

    def __getstate__(self) -> dict[str, Any]:
        # an inline worker is rebuilt where the client lands; the actor is found by its name
        return {**self.__dict__, "_local": None, "_actor": None}

    @property
    def worker(self) -> RewardWorker:
        if self._local is None:
            self._local = RewardWorker(self.sources, self.settings)
        return self._local

    def actor(self) -> Any:
        """The reward actor (started by the first caller anywhere in the cluster)."""
        if self._actor is None:
            import ray

            if not ray.is_initialized():
                ray.init(include_dashboard=False)
            s = RewardWorkerSection.model_validate(self.settings)
            cls = ray.remote(num_cpus=s.num_cpus, num_gpus=s.num_gpus)(RewardWorker)
            self._actor = cls.options(name=self.actor_name, get_if_exists=True,
                                      max_concurrency=1000).remote(self.sources, self.settings)
        return self._actor

    @property
    def total_timeout_s(self) -> float:
        s = RewardWorkerSection.model_validate(self.settings)
        backoff = sum(s.retry_backoff_s * 2**k for k in range(s.retries))
        return s.timeout_s * (s.retries + 2) + backoff

    async def score(self, request: ScoreRequest) -> ScoreResult:
        if self.placement == "actor":
            return await self.actor().score.remote(request)  # type: ignore[no-any-return]
        return await self.worker.score(request)

    async def score_trajectory(self, traj: Trajectory) -> Trajectory:
        """``traj`` with its combined reward, or failed with the reason (never raises)."""
        if traj.failed or not traj.samples:
            return traj
        try:
            result = await asyncio.wait_for(self.score(ScoreRequest.from_trajectory(traj)),
                                            self.total_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            result = ScoreResult(error=f"no score within {self.total_timeout_s:.0f} s")
        except Exception as exc:  # noqa: BLE001 -- the reward actor died
            result = ScoreResult(error=f"reward worker: {type(exc).__name__}: {exc}")
        return apply_score(traj, result)

    async def close(self) -> None:
        """Stop the actor (if Ray still runs) or the inline worker."""
        if self.placement == "actor":
            import ray

            if ray.is_initialized():
                try:
                    ray.kill(ray.get_actor(self.actor_name))
                except ValueError:  # never started, or gone with the worker that owned it
                    pass
            self._actor = None
        if self._local is not None:
            await self._local.close()
            self._local = None


def reward_client(sources: Sequence[RewardSourceConfig], settings: RewardWorkerSection,
                  cluster: str) -> RewardClient | None:
    """The client of a run's ``[[rewards]]`` (None when only the env's reward counts)."""
    only_env = len(sources) == 1 and sources[0].kind == "env" and sources[0].weight == 1.0
    if not sources or (only_env and sources[0].per == "episode"):
        return None  # what the env gave is already the reward
    placement = settings.placement
    if placement == "auto":
        placement = "actor" if cluster == "ray" else "inline"
    return RewardClient(sources, settings, placement=placement)


__all__ = ["RewardClient", "RewardWorker", "reward_client"]

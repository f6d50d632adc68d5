"""`evaluate`: benchmarks x tasks x n samples through a policy, resumable, with live progress.

Every sample is one episode played by the policy through `palaestra.rollout.play.play_episode` (token
level: a `TokenPlayer` with the benchmark's agent; message level: a chat API's `ChatPlayer`)
against a fresh reset of a pooled env, at most ``concurrency`` at a time. A finished sample is
appended to ``samples.jsonl`` at once; a sample whose *engine* failed (unreachable, HTTP errors
after the retries) is not stored, so a rerun retries it, and too many of those in a row stop the
run with the engine's error instead of filling the file with failures.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from palaestra.benchmarks.envpool import EnvPool, Tasks, preflight
from palaestra.benchmarks.records import engine_failure, make_record, sample_seed
from palaestra.benchmarks.registry import get_benchmark
from palaestra.benchmarks.spec import Benchmark
from palaestra.benchmarks.store import SampleKey, SampleStore, check_run_meta, key_of, light
from palaestra.benchmarks.summary import summarize, write_summary
from palaestra.engine import SamplingParams
from palaestra.errors import ConfigError, EngineError
from palaestra.progress import progress_bar
from palaestra.rollout.episode import EpisodeRequest, Player
from palaestra.types import StopReason, Trajectory

if TYPE_CHECKING:
    from palaestra.contracts import RolloutEnv

#: Episodes that may leave their env mid-step (a timed-out step, an exception): not reused.
_UNSAFE = (StopReason.TIMEOUT, StopReason.ERROR)


@dataclass(frozen=True)
class SampleRequest:
    """One sample to play: its sampling, the env seed and task, and the episode's limits."""

    sampling: SamplingParams
    seed: int | None
    task: Mapping[str, Any] | None
    session_id: str
    max_turns: int | None
    step_timeout_s: float | None

    def to_episode(self, env: RolloutEnv, player: Player, *, env_id: str = "") -> EpisodeRequest:
        """The rollout's `EpisodeRequest` of this sample for ``env`` played by ``player``."""
        return EpisodeRequest(
            env, player, self.sampling, seed=self.seed, task=self.task,
            session_id=self.session_id, max_turns=self.max_turns,
            step_timeout_s=self.step_timeout_s, env_id=env_id,
        )


class Policy(Protocol):
    """What plays the episodes: a token-level engine + agent, or a chat (message-level) API."""

    #: the model name samples are keyed by
    model: str

    async def check(self) -> None:
        """Raise a clear `EngineError`/`ConfigError` when the model cannot be used (before work)."""

    async def play(self, env: RolloutEnv, benchmark: Benchmark, request: SampleRequest
                   ) -> Trajectory:
        """Play one episode; failures come back on the trajectory, never as exceptions."""

    async def close(self) -> None: ...


@dataclass(frozen=True)
class EvalSettings:
    """How many samples and how to draw them (the CLI flags of `palaestra eval`)."""

    n: int = 1
    temperature: float = 0.6
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int | None = None  # None: each benchmark's own
    max_turns: int | None = None  # None: the env's own
    limit: int | None = None
    concurrency: int = 64
    seed: int = 0
    step_timeout_s: float | None = 600.0
    max_engine_failures: int = 8  # engine failures in a row that stop the run

    def __post_init__(self) -> None:
        problems = []
        if self.n < 1:
            problems.append(f"n must be >= 1, got {self.n}")
        if self.concurrency < 1:
            problems.append(f"concurrency must be >= 1, got {self.concurrency}")
        if self.limit is not None and self.limit < 1:
            problems.append(f"limit must be >= 1, got {self.limit}")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if problems:
            raise ConfigError("bad evaluation settings: " + "; ".join(problems))

    def resume_key(self) -> dict[str, Any]:
        """Settings that change what a sample is; a resumed run must use the same ones."""
        d = asdict(self)
        for volatile in ("n", "limit", "concurrency", "step_timeout_s", "max_engine_failures"):
            d.pop(volatile)
        return d


class _MemoryStore:
    """`SampleStore` without a file (evaluation during training without an output folder)."""

    def __init__(self) -> None:
        self.records: dict[SampleKey, dict[str, Any]] = {}

    def __contains__(self, key: SampleKey) -> bool:
        return key in self.records

    def append(self, record: dict[str, Any]) -> None:
        self.records[key_of(record)] = light(record)

    def close(self) -> None:
        pass


async def _run_benchmark(
    benchmark: Benchmark,
    tasks: Tasks,
    policy: Policy,
    settings: EvalSettings,
    store: Any,
    env_kwargs: Mapping[str, Any],
    progress: bool,
) -> list[dict[str, Any]]:
    model = policy.model
    n = settings.n
    wanted = [(tid, row, seed, i) for tid, row, seed in tasks for i in range(n)]
    keys = [(benchmark.name, w[0], w[3], model) for w in wanted]
    todo = [w for w, k in zip(wanted, keys) if k not in store]
    done = [store.records[k] for k in keys if k in store]
    counts = {"done": len(done), "correct": sum(bool(r["correct"]) for r in done), "fails": 0}
    bar = _progress(benchmark.name, len(wanted), counts, enabled=progress)
    pool = EnvPool(benchmark, env_kwargs)
    gate = asyncio.Semaphore(settings.concurrency)
    max_new = settings.max_new_tokens or benchmark.max_new_tokens
    fatal: list[str] = []

    async def one(task_id: str, row: dict[str, Any] | None, task_seed: int | None, i: int) -> None:
        async with gate:
            if fatal:
                return
            seed = sample_seed(settings.seed, benchmark.name, task_id, i)
            env = pool.acquire()
            began = time.perf_counter()
            traj = None
            try:
                traj = await policy.play(env, benchmark, SampleRequest(
                    sampling=SamplingParams(
                        max_new_tokens=max_new, temperature=settings.temperature,
                        top_p=settings.top_p, top_k=settings.top_k, seed=seed),
                    seed=task_seed if task_seed is not None else seed,
                    task=row,
                    session_id=f"{benchmark.name}/{task_id}/{i}",
                    max_turns=settings.max_turns or benchmark.max_turns,
                    step_timeout_s=settings.step_timeout_s,
                ))
            finally:
                pool.release(env, reusable=traj is not None and traj.stop_reason not in _UNSAFE)
            elapsed = time.perf_counter() - began
            if engine_failure(traj):
                counts["fails"] += 1
                if counts["fails"] >= settings.max_engine_failures:
                    fatal.append(traj.error or "engine failure")
                return
            counts["fails"] = 0
            record = make_record(benchmark, task_id, i, model, seed, traj, elapsed, row=row)
            store.append(record)
            counts["done"] += 1
            counts["correct"] += bool(record["correct"])
            _tick(bar, counts)

    tasks_ = [asyncio.ensure_future(one(*w)) for w in todo]
    try:
        await asyncio.gather(*tasks_)
    except BaseException:
        for t in tasks_:  # a bug (not a failed episode) stops the whole benchmark cleanly
            t.cancel()
        await asyncio.gather(*tasks_, return_exceptions=True)
        raise
    finally:
        pool.close()
        if bar is not None:
            bar.close()
    if fatal:
        raise EngineError(
            f"{benchmark.name}: the engine failed {settings.max_engine_failures} episodes in a row "
            f"(last: {fatal[0]}); finished samples are saved, rerun the same command to resume"
        )
    return [store.records[k] for k in keys if k in store]


def _progress(name: str, total: int, counts: Mapping[str, int], *, enabled: bool) -> Any:
    if not enabled:
        return None
    bar = progress_bar(total, initial=counts["done"], desc=name, unit="sample")
    _tick(bar, counts, advance=False)
    return bar


def _tick(bar: Any, counts: Mapping[str, int], *, advance: bool = True) -> None:
    if bar is None:
        return
    if advance:
        bar.update(1)
    acc = counts["correct"] / counts["done"] if counts["done"] else 0.0
    bar.set_postfix(acc=f"{acc:.3f}", refresh=False)


def _describe_source(source: Any) -> str:
    """A stable name of a dataset source (a callable's qualified name, not its address)."""
    if source is None:
        return "generated"
    if callable(source):
        return f"{getattr(source, '__module__', '')}.{getattr(source, '__qualname__', repr(source))}"
    return str(source)


async def evaluate(
    benchmarks: Sequence[Benchmark | str],
    policy: Policy,
    settings: EvalSettings,
    *,
    out_dir: str | Path | None = None,
    env_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    datasets: Mapping[str, str] | None = None,
    progress: bool = True,
    report: bool = True,
    header: Mapping[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Evaluate ``policy`` on ``benchmarks``; returns ``{benchmark: summary}``.

    With ``out_dir`` the samples, ``summary.json`` and (``report=True``) ``report.md`` with its
    plots are written there, and a rerun resumes from the samples already in it.
    """
    resolved = [b if isinstance(b, Benchmark) else get_benchmark(b) for b in benchmarks]
    env_kwargs = dict(env_kwargs or {})
    datasets = dict(datasets or {})
    tasks = preflight(resolved, env_kwargs, datasets, settings.limit)
    await policy.check()
    store: Any
    if out_dir is not None:
        meta = {
            b.name: {
                **settings.resume_key(),
                "max_new_tokens": settings.max_new_tokens or b.max_new_tokens,
                "env_kwargs": {**b.env_kwargs, **env_kwargs.get(b.name, {})},
                "dataset": _describe_source(datasets.get(b.name, b.dataset)),
                "agent": dict(b.agent),
            }
            for b in resolved
        }
        check_run_meta(out_dir, policy.model, meta)
        store = SampleStore(out_dir).open()
    else:
        store = _MemoryStore()
    summaries: dict[str, dict[str, Any]] = {}
    records: dict[str, list[dict[str, Any]]] = {}
    began = time.perf_counter()
    try:
        for b in resolved:
            rows = await _run_benchmark(
                b, tasks[b.name], policy, settings, store, env_kwargs.get(b.name, {}), progress
            )
            records[b.name] = rows
            summaries[b.name] = summarize(rows, with_maj=b.answer is not None)
            if out_dir is not None:
                write_summary(out_dir, summaries)
    finally:
        store.close()
    if out_dir is not None and report:
        from palaestra.benchmarks.report import write_report

        info = {
            "model": policy.model,
            **(header or {}),
            **asdict(settings),
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
            "wall time of this invocation": f"{time.perf_counter() - began:.1f} s",
        }
        write_report(
            out_dir,
            summaries,
            records,
            header=info,
            descriptions={b.name: b.description for b in resolved},
        )
    return summaries


__all__ = ["EvalSettings", "Policy", "evaluate"]

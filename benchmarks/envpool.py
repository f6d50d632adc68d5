"""Envs for evaluation: a per-benchmark pool of reusable envs, and the checks run before any work.

`preflight` verifies every benchmark at once (env registered, required options given, data
readable, one env builds) and raises a single `ConfigError` listing every problem.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from palaestra.benchmarks.spec import Benchmark
from palaestra.benchmarks.registry import (
    check_requirements,
    env_available,
    load_tasks,
)
from palaestra.errors import ConfigError

if TYPE_CHECKING:
    from palaestra.contracts import RolloutEnv

#: (task id, task row or None, env seed or None) of each task of a benchmark
Tasks = list[tuple[str, dict[str, Any] | None, int | None]]


class EnvPool:
    """Envs of one benchmark, created on demand and reused across episodes (reset each time)."""

    def __init__(self, benchmark: Benchmark, env_kwargs: Mapping[str, Any]) -> None:
        self.benchmark = benchmark
        self.kwargs = {**benchmark.env_kwargs, **env_kwargs}
        self.free: list[Any] = []
        self.all: list[Any] = []

    def make(self) -> Any:
        from palaestra.benchmarks.prompts import apply_prompt
        from palaestra.envs import make

        env = make(self.benchmark.env_id, **self.kwargs)
        return apply_prompt(env, self.benchmark.prompt_template, self.benchmark.system_prompt)

    def acquire(self) -> Any:
        if self.free:
            return self.free.pop()
        env = self.make()
        self.all.append(env)
        return env

    def release(self, env: RolloutEnv, *, reusable: bool = True) -> None:
        if reusable:
            self.free.append(env)
            return
        # a step that timed out may still run in a worker thread: never reset this env again
        self.all.remove(env)
        try:
            env.close()
        except Exception:  # best effort
            pass

    def close(self) -> None:
        for env in self.all:
            try:
                env.close()
            except Exception:  # closing is best effort at the end of a run
                pass


def preflight(
    benchmarks: Sequence[Benchmark],
    env_kwargs: Mapping[str, Mapping[str, Any]],
    datasets: Mapping[str, str],
    limit: int | None,
) -> dict[str, Tasks]:
    """Check every benchmark (env registered, requirements, data, one env builds) before work."""
    problems: list[str] = []
    tasks: dict[str, Tasks] = {}
    for b in benchmarks:
        why = env_available(b)
        if why is None:
            why = check_requirements(b, {**b.env_kwargs, **env_kwargs.get(b.name, {})})
        if why is None:
            try:
                tasks[b.name] = load_tasks(b, limit=limit, dataset=datasets.get(b.name))
                EnvPool(b, env_kwargs.get(b.name, {})).make().close()
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
        if why is not None:
            problems.append(f"{b.name}: {why}")
    if problems:
        raise ConfigError("cannot evaluate:\n  " + "\n  ".join(problems))
    return tasks


__all__ = ["EnvPool", "Tasks", "preflight"]

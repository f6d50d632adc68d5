"""The benchmark registry: a benchmark = dataset + env id + env kwargs + prompt template + metrics.

A user registers a benchmark in a few lines::

    from palaestra.benchmarks import Benchmark, register_benchmark

    register_benchmark(Benchmark(
        name="my-arith",
        env_id="palaestra/Calculator-v0",
        dataset="data/my_arith.jsonl",          # rows in the env's task format
        prompt_template="{prompt}\\nThink step by step.",
        answer="tag",                            # maj@k reads <answer>...</answer>
    ))

and evaluates it with ``palaestra eval --benchmark my-arith --import my_module`` (or from Python).
The built-in benchmarks (`palaestra.benchmarks.builtin`) are registered on first use; the
`Benchmark` record itself is `palaestra.benchmarks.spec`.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from palaestra.benchmarks.spec import Benchmark
from palaestra.errors import ConfigError

_REGISTRY: dict[str, Benchmark] = {}
_BUILTINS_LOADED = False


def register_benchmark(benchmark: Benchmark, *, overwrite: bool = False) -> Benchmark:
    """Add a benchmark; registering the same definition twice is a no-op."""
    _ensure_builtins()
    existing = _REGISTRY.get(benchmark.name)
    if existing is not None and existing != benchmark and not overwrite:
        raise ConfigError(
            f"a different benchmark is already registered as {benchmark.name!r}; pick another "
            "name or pass overwrite=True"
        )
    _REGISTRY[benchmark.name] = benchmark
    return benchmark


def get_benchmark(name: str) -> Benchmark:
    _ensure_builtins()
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(
            f"no benchmark named {name!r}.{hint} `palaestra eval list` shows the registered ones; "
            "register your own with palaestra.benchmarks.register_benchmark (see "
            "docs/evaluation.md) and load its module with --import"
        )
    return _REGISTRY[name]


def list_benchmarks() -> list[Benchmark]:
    _ensure_builtins()
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def unregister_benchmark(name: str) -> None:
    _REGISTRY.pop(name, None)


def _ensure_builtins() -> None:
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    _BUILTINS_LOADED = True
    from palaestra.benchmarks.builtin import BUILTIN_BENCHMARKS

    for benchmark in BUILTIN_BENCHMARKS:
        _REGISTRY.setdefault(benchmark.name, benchmark)


def env_available(benchmark: Benchmark) -> str | None:
    """None when the benchmark's env is registered, else the reason it is not."""
    from palaestra.envs.registry import lookup
    from palaestra.errors import EnvNotFoundError

    try:  # the registry's own resolution: "module:Id-v0", "verifiers:<id>", bare ids
        lookup(benchmark.env_id)
    except (EnvNotFoundError, ImportError) as exc:
        return str(exc)
    return None


def load_tasks(
    benchmark: Benchmark,
    *,
    limit: int | None = None,
    dataset: str | Path | None = None,
) -> list[tuple[str, dict[str, Any] | None, int | None]]:
    """The benchmark's tasks as ``(task_id, row or None, seed or None)``, first ``limit`` of them.

    Rows come from ``dataset`` (a user path overriding the benchmark's) or the benchmark's own
    source; generated benchmarks (no dataset) give seeds instead of rows.
    """
    from palaestra.envs.base import task_id_of

    source = dataset if dataset is not None else benchmark.dataset
    if source is None:
        count = benchmark.num_tasks if limit is None else min(limit, benchmark.num_tasks)
        return [(f"seed-{i}", None, i) for i in range(count)]
    rows = _read_rows(benchmark, source)
    if benchmark.rows is not None:
        rows = list(benchmark.rows(rows))
    if limit is not None:
        rows = rows[: max(0, limit)]
    if not rows:
        raise ConfigError(f"benchmark {benchmark.name!r}: the dataset {source!s} has no tasks")
    out: list[tuple[str, dict[str, Any] | None, int | None]] = []
    seen: set[str] = set()
    for row in rows:
        task_id = task_id_of(row)
        if task_id in seen:  # duplicated rows would collide in samples.jsonl
            raise ConfigError(
                f"benchmark {benchmark.name!r}: task id {task_id!r} occurs twice; give every row a "
                "unique 'id' field"
            )
        seen.add(task_id)
        out.append((task_id, row, None))
    return out


@functools.lru_cache(maxsize=32)
def _rows_of_file(path: str, mtime_ns: int, size: int) -> tuple[dict[str, Any], ...]:
    from palaestra.envs.shipped import iter_jsonl

    return tuple(iter_jsonl(path))


def _read_rows(benchmark: Benchmark, source: Any) -> list[dict[str, Any]]:
    from palaestra.envs.shipped import shipped_path

    if callable(source):
        return [dict(r) for r in source()]
    path = Path(source)
    if not path.exists():
        try:
            path = shipped_path(str(source))
        except ConfigError:
            raise ConfigError(
                f"benchmark {benchmark.name!r}: dataset {str(source)!r} is neither a file nor a "
                "shipped data file; pass --dataset PATH to a JSON-lines file"
                + (f" ({benchmark.requires})" if benchmark.requires else "")
            ) from None
    stat = path.stat()  # cached per (path, mtime, size): an edited file is read again
    return [dict(r) for r in _rows_of_file(str(path.resolve()), stat.st_mtime_ns, stat.st_size)]


def check_requirements(benchmark: Benchmark, env_kwargs: Mapping[str, Any]) -> str | None:
    """None when the user supplied what the benchmark needs, else what is missing and how."""
    missing = [k for k in benchmark.required_env_kwargs if k not in env_kwargs]
    if not missing:
        return None
    how = benchmark.requires or "pass them with --env-kwargs JSON"
    return f"benchmark {benchmark.name!r} needs env kwargs {missing}: {how}"


def resolve(names: Sequence[str]) -> list[Benchmark]:
    """Benchmarks by name, checking all of them before any work starts."""
    found, problems = [], []
    for name in names:
        try:
            found.append(get_benchmark(name))
        except ConfigError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError("\n".join(problems))
    return found


__all__ = [
    "check_requirements",
    "env_available",
    "get_benchmark",
    "list_benchmarks",
    "load_tasks",
    "register_benchmark",
    "resolve",
    "unregister_benchmark",
]

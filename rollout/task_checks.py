"""Load-time checks of what a run will feed its envs: env ids, env kwargs and task files.

Nothing here builds an env: an id is looked up in gymnasium's registry (importing the module
named before ``:``, as `palaestra.envs.make` does), the class is imported from its entry point,
and rows are checked against the class's `Env.task_problems` (its ``task_fields``). A data file
with at most `SCAN_ALL_ROWS` rows is checked whole, a larger one by its first `SCAN_ALL_ROWS`
rows (every row is still counted). No torch, no Ray.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from palaestra.errors import ConfigError, EnvNotFoundError
from palaestra.jsonl import jsonl_lines
from palaestra.rollout.data import ENV_KEYS, describe_bad_rows

#: files with at most this many rows are checked whole; larger ones by their first rows
SCAN_ALL_ROWS = 10_000

RowCheck = Callable[[Any], list[str]]


def env_class(env_id: str) -> type | None:
    """The class registered as ``env_id`` (None for a factory function), without building it.

    Raises `EnvNotFoundError` with the close matches when the id is not registered.
    """
    from palaestra.envs.registry import lookup

    _, spec = lookup(env_id)
    entry = spec.entry_point
    if isinstance(entry, str):
        module_name, _, attr = entry.partition(":")
        try:
            entry = getattr(importlib.import_module(module_name), attr)
        except ImportError:  # an env whose extra is missing fails when it is built, with the fix
            return None
    return entry if inspect.isclass(entry) else None


def unknown_kwargs(cls: type, kwargs: Mapping[str, Any]) -> list[str]:
    """Keys of ``kwargs`` that the constructor of ``cls`` (and the ``**kwargs`` chain of its
    bases) does not take, each with its close match; empty when that cannot be told."""
    accepted: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            return []
        accepted |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    else:
        return []  # every constructor forwards **kwargs: anything may be accepted
    accepted.discard("self")
    out = []
    for key in kwargs:
        if key not in accepted:
            close = difflib.get_close_matches(key, sorted(accepted), n=1)
            out.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return out


def task_row_check(default_env_id: str) -> RowCheck:
    """A check of one data row: an object, naming a registered env, carrying its task fields."""
    classes: dict[str, type | None] = {}
    unknown: dict[str, str] = {}

    def check(row: Any) -> list[str]:
        if not isinstance(row, Mapping):
            return [_not_an_object(row)]
        env_id = str(next((row[k] for k in ENV_KEYS if row.get(k)), default_env_id))
        if env_id not in classes and env_id not in unknown:
            try:
                classes[env_id] = env_class(env_id)
            except EnvNotFoundError as exc:
                unknown[env_id] = str(exc).split(" `palaestra", 1)[0]
        if env_id in unknown:
            return [f"names env {env_id!r}: {unknown[env_id]}"]
        cls = classes[env_id]
        problems_of = getattr(cls, "task_problems", None)
        if problems_of is None:
            return []
        task = row["task"] if isinstance(row.get("task"), Mapping) else {
            k: v for k, v in row.items() if k not in ENV_KEYS}
        fields = getattr(cls, "task_fields", ())
        need = f" ({env_id} needs {_fields_text(fields)})" if fields else ""
        return [f"{p}{need}" for p in problems_of(task)]

    return check


def _not_an_object(row: Any) -> str:
    kinds = {list: "an array", str: "a string", int: "a number", float: "a number",
             bool: "a boolean", type(None): "null"}
    return f"is {kinds.get(type(row), 'a ' + type(row).__name__)}, not a JSON object"


def _fields_text(fields: tuple[str | tuple[str, ...], ...]) -> str:
    return ", ".join(repr(f) if isinstance(f, str) else " or ".join(map(repr, f)) for f in fields)


def field_check(*fields: str) -> RowCheck:
    """A check that a row is an object with every one of ``fields`` (offline datasets)."""

    def check(row: Any) -> list[str]:
        if not isinstance(row, Mapping):
            return [_not_an_object(row)]
        missing = [f for f in fields if f not in row]
        return [f"missing {', '.join(map(repr, missing))}"] if missing else []

    return check


@dataclass(frozen=True)
class RowScan:
    """What `scan_rows` found: rows counted, rows checked, and the unusable ones."""

    num_rows: int
    checked: int
    problems: tuple[str, ...]  # "line 3: missing 'answer' ..." (or "row 3" outside JSONL)

    def describe(self) -> str:
        text = describe_bad_rows(self.problems, self.checked)
        if self.checked < self.num_rows:
            text += f"\n    (the first {self.checked} of {self.num_rows} rows were checked)"
        return text


def scan_rows(path: str | Path, check: RowCheck, *, limit: int = SCAN_ALL_ROWS,
              split: str = "train") -> RowScan:
    """Count the rows of a data file and check the first ``limit`` of them with ``check``.

    File-level problems (missing, not a data file, unreadable) raise `ConfigError`.
    """
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{str(p)!r} does not exist; check the path")
    if p.is_file() and p.stat().st_size == 0:
        raise ConfigError(f"{str(p)!r} is empty; it needs one task row per line")
    problems: list[str] = []
    count = checked = 0
    if p.is_file() and p.suffix.lower() == ".jsonl":
        for n, row, error in jsonl_lines(p):
            count += 1
            if count > limit:
                continue
            checked += 1
            errors = [error] if error else check(row)
            if errors:
                problems.append(f"line {n}: " + "; ".join(errors))
    else:
        count, rows = _head(p, limit, split)
        checked = len(rows)
        for i, row in enumerate(rows, 1):
            errors = check(row)
            if errors:
                problems.append(f"row {i}: " + "; ".join(errors))
    if count == 0:
        raise ConfigError(f"{str(p)!r} has no rows; it needs one task row per line")
    return RowScan(count, checked, tuple(problems))


def _head(path: Path, limit: int, split: str) -> tuple[int, list[Any]]:
    """(row count, the first ``limit`` rows) of a .json, .parquet or datasets folder."""
    if path.is_file() and path.suffix.lower() == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise ConfigError(f"reading {path.name} needs pyarrow: pip install pyarrow") from exc
        parquet = pq.ParquetFile(path)
        batch = next(parquet.iter_batches(batch_size=limit), None)
        return parquet.metadata.num_rows, batch.to_pylist() if batch is not None else []
    if path.is_dir():
        if not any((path / f).is_file() for f in ("dataset_dict.json", "state.json")):
            raise ConfigError(f"{str(path)!r} is a folder but not one written by datasets' "
                              "save_to_disk; point at a .jsonl/.json/.parquet file or such a folder")
        from palaestra.rollout.data import open_hf_folder

        ds = open_hf_folder(path, split)
        return ds.num_rows, ds.select(range(min(limit, ds.num_rows))).to_list()
    from palaestra.rollout.data import load_rows

    rows = load_rows(path, split=split)
    return len(rows), rows[:limit]


__all__ = ["SCAN_ALL_ROWS", "RowScan", "env_class", "field_check", "scan_rows", "task_row_check",
           "unknown_kwargs"]

"""The data source: task rows naming their env, drawn in seeded-shuffled epochs, resumable.

A row is either ``{"env_id": "palaestra/Calculator-v0", "task": {...}}`` or a flat task row with an
``env_id`` field (``{"env_id": ..., "question": ..., "answer": ...}``); rows without an env id use
the source's default ``env_id``. Files: ``.jsonl``, ``.json`` (a list), ``.parquet``, or a folder
written by Hugging Face ``datasets`` (``save_to_disk``). Each epoch visits every row once in an
order drawn from ``(seed, epoch)``; `state_dict` / `load_state_dict` save and restore the position
(checkpoints), so a resumed run draws exactly the tasks an uninterrupted one would have drawn.
`split_held_out` splits a file's held-out tail off its training rows (``palaestra train`` holds
out the last ``eval.num_tasks`` rows and never trains on them); `without_tasks` drops training
rows that repeat a held-out task.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from palaestra.envs.base import task_id_of
from palaestra.errors import CheckpointError, ConfigError
from palaestra.jsonl import jsonl_lines

ENV_KEYS = ("env_id", "env")
R = TypeVar("R", bound=Mapping[str, Any])


@dataclass(frozen=True)
class TaskItem:
    """One draw from the data source: which env, which task, and where it came from."""

    env_id: str
    task: Mapping[str, Any]
    task_id: str
    index: int  # row index in the dataset
    epoch: int
    seed: int  # deterministic per (source seed, epoch, row); episode seeds derive from it


def load_rows(path: str | Path, *, split: str = "train") -> list[dict[str, Any]]:
    """Rows of a ``.jsonl`` (or gzipped ``.jsonl.gz``), ``.json`` or ``.parquet`` file, or of a
    ``datasets.save_to_disk`` folder."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"data file {str(p)!r} does not exist; check the path in your config")
    if p.is_dir():
        return _load_hf_folder(p, split)
    suffix = ".jsonl" if p.name.lower().endswith(".jsonl.gz") else p.suffix.lower()
    if suffix == ".jsonl":
        rows, bad = [], []
        for n, row, error in jsonl_lines(p):
            if error is None:
                rows.append(row)
            else:
                bad.append(f"{p}:{n}: {error}")  # path:line, as editors jump to it
        if bad:
            raise ConfigError(f"{p.name}: {describe_bad_rows(bad, len(bad) + len(rows))}")
        return rows
    if suffix == ".json":
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{p}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(data, list):
            raise ConfigError(f"{p}: a .json data file must hold a list of row objects")
        return data
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise ConfigError(f"reading {p.name} needs pyarrow: pip install pyarrow") from exc
        return pq.read_table(p).to_pylist()
    raise ConfigError(
        f"unsupported data file {p.name!r}; use .jsonl, .jsonl.gz, .json, .parquet or a folder "
        "saved with datasets' save_to_disk"
    )


def describe_bad_rows(problems: Sequence[str], checked: int, shown: int = 5) -> str:
    """``"3 of 40 rows are unusable: line 2: ...; ..."``, the first ``shown`` of them named."""
    head = "\n    ".join(problems[:shown])
    more = f"\n    ... and {len(problems) - shown} more" if len(problems) > shown else ""
    return (f"{len(problems)} of {checked} rows are unusable; fix or remove them:"
            f"\n    {head}{more}")


def split_held_out(rows: Sequence[R], num_held_out: int) -> tuple[list[R], list[R]]:
    """``(train rows, held-out rows)``: the last ``num_held_out`` rows are held out, never
    trained on. Raises when no training row would remain."""
    if num_held_out >= len(rows):
        raise ConfigError(
            f"the data has {len(rows)} rows, too few to hold out eval.num_tasks = {num_held_out} "
            "and train on the rest; lower eval.num_tasks or add rows"
        )
    cut = len(rows) - num_held_out
    return list(rows[:cut]), list(rows[cut:])


def without_tasks(rows: Sequence[R], others: Sequence[Mapping[str, Any]]) -> list[R]:
    """``rows`` less those that pose one of ``others``' tasks (same env id and task id), e.g.
    training draws that repeat a held-out draw of an env with a finite dataset."""
    taken = {_task_key(row) for row in others}
    return [row for row in rows if _task_key(row) not in taken]


def _task_key(row: Mapping[str, Any]) -> tuple[Any, str]:
    env_id = next((row[k] for k in ENV_KEYS if row.get(k)), None)
    task = row["task"] if isinstance(row.get("task"), Mapping) else {
        k: v for k, v in row.items() if k not in ENV_KEYS}
    return env_id, task_id_of(task)


def open_hf_folder(path: Path, split: str) -> Any:
    """The ``split`` of a folder written by datasets' ``save_to_disk`` (a ``datasets.Dataset``)."""
    try:
        import datasets
    except ImportError as exc:
        raise ConfigError(f"{path} is a folder; reading it needs: pip install datasets") from exc
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ConfigError(f"{path} has splits {sorted(ds)} and no {split!r}; "
                              "choose one with split=...")
        ds = ds[split]
    return ds


def _load_hf_folder(path: Path, split: str) -> list[dict[str, Any]]:
    return open_hf_folder(path, split).to_list()


class DataSource:
    """Seeded epochs over task rows with a resumable position."""

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        *,
        env_id: str | None = None,
        shuffle: bool = True,
        seed: int = 0,
        epochs: int | None = 1,
    ) -> None:
        if epochs is not None and epochs < 1:
            raise ConfigError(f"epochs must be >= 1 or None (endless), got {epochs}")
        self._items = [_split_row(row, env_id, i) for i, row in enumerate(rows)]
        if not self._items:
            raise ConfigError("the data source has no rows; check the data file")
        self.shuffle = shuffle
        self.seed = int(seed)
        self.epochs = epochs
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    @classmethod
    def from_files(
        cls, paths: str | Path | Sequence[str | Path], *, split: str = "train", **kwargs: Any
    ) -> DataSource:
        """Concatenate the rows of one or more data files (see `load_rows`)."""
        if isinstance(paths, (str, Path)):
            paths = [paths]
        rows: list[dict[str, Any]] = []
        for p in paths:
            rows.extend(load_rows(p, split=split))
        return cls(rows, **kwargs)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def exhausted(self) -> bool:
        return self.epochs is not None and self.epoch >= self.epochs

    def next(self) -> TaskItem | None:
        """The next task, or None once every epoch has been drawn."""
        if self.exhausted:
            return None
        index = int(self._order[self.position])
        env_id, task, task_id = self._items[index]
        item = TaskItem(env_id, task, task_id, index, self.epoch, _mix(self.seed, self.epoch, index))
        self.position += 1
        if self.position >= len(self._items):
            self.epoch += 1
            self.position = 0
            self._order = self._permutation(self.epoch)
        return item

    def __iter__(self) -> Iterator[TaskItem]:
        while (item := self.next()) is not None:
            yield item

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_rows": len(self._items),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state["num_rows"]) != len(self._items):
            raise CheckpointError(
                f"the checkpoint's data position is for {state['num_rows']} rows but the data "
                f"source has {len(self._items)}; resume with the same data files"
            )
        position = int(state["position"])
        if not 0 <= position < len(self._items):
            raise CheckpointError(f"data position {position} is out of range")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = position
        self._order = self._permutation(self.epoch)

    def _permutation(self, epoch: int) -> np.ndarray:
        n = len(self._items)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)


def _split_row(
    row: Mapping[str, Any], default_env: str | None, index: int
) -> tuple[str, dict[str, Any], str]:
    if not isinstance(row, Mapping):
        raise ConfigError(f"row {index} is a {type(row).__name__}, expected an object")
    env_id = next((row[k] for k in ENV_KEYS if row.get(k)), default_env)
    if not env_id:
        raise ConfigError(
            f"row {index} names no env (no 'env_id' field) and the data source has no default; "
            "add an env_id column or pass env_id=... to the data source"
        )
    if isinstance(row.get("task"), Mapping):
        task = dict(row["task"])
    else:
        task = {k: v for k, v in row.items() if k not in ENV_KEYS}
    return str(env_id), task, task_id_of(task)


def _mix(seed: int, epoch: int, index: int) -> int:
    """A 31-bit seed from (seed, epoch, index), stable across processes and Python versions."""
    x = (seed * 0x9E3779B1 + epoch * 0x85EBCA77 + index * 0xC2B2AE3D) & 0xFFFFFFFFFFFF
    x ^= x >> 29
    x = (x * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    return int((x ^ (x >> 32)) & 0x7FFFFFFF)


__all__ = ["DataSource", "TaskItem", "describe_bad_rows", "load_rows",
           "split_held_out", "without_tasks"]

"""The run directory's ``samples.jsonl``: one record per (benchmark, task, sample index, model).

Records are appended, flushed and fsynced one at a time, so a crash loses at most the samples still
in flight; a line cut short by a crash is dropped (and the file trimmed back to its last complete
line) when the run is resumed. ``run.json`` remembers the settings of each model evaluated in the
directory, so a resumed run cannot silently mix samples drawn with different settings.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from palaestra.errors import ConfigError

SAMPLES = "samples.jsonl"
RUN_META = "run.json"

SampleKey = tuple[str, str, int, str]  # benchmark, task id, sample index, model


def key_of(record: Mapping[str, Any]) -> SampleKey:
    return (
        str(record["benchmark"]),
        str(record["task_id"]),
        int(record["sample"]),
        str(record["model"]),
    )


def read_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """Complete records of a samples file (a torn last line is skipped)."""
    path = Path(path)
    if not path.exists():
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break  # torn write at the end of a crashed run
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn line (only possible at the end, before a resume trimmed it)
            if isinstance(record, dict) and "benchmark" in record:
                yield record


def light(record: Mapping[str, Any]) -> dict[str, Any]:
    """A record without its trajectory (what is kept in memory: metrics need only this)."""
    return {k: v for k, v in record.items() if k != "trajectory"}


def find_record(path: str | Path, key: SampleKey) -> dict[str, Any] | None:
    """The full record (with its trajectory) of one sample, read back from the file."""
    for record in read_records(path):
        if key_of(record) == key:
            return record
    return None


class SampleStore:
    """Append-only store of finished samples, indexed by key for resume.

    Only the light part of each record stays in memory (trajectories can be large); the full
    record is on disk.
    """

    def __init__(self, out_dir: str | Path) -> None:
        self.dir = Path(out_dir)
        self.path = self.dir / SAMPLES
        self.records: dict[SampleKey, dict[str, Any]] = {}
        self._file: Any = None

    def open(self) -> SampleStore:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._trim_torn_tail()
        for record in read_records(self.path):
            self.records[key_of(record)] = light(record)
        self._file = open(self.path, "a", encoding="utf-8")
        return self

    def _trim_torn_tail(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb+") as f:
            data = f.read()
            if not data or data.endswith(b"\n"):
                return
            f.truncate(data.rfind(b"\n") + 1)

    def __contains__(self, key: SampleKey) -> bool:
        return key in self.records

    def append(self, record: dict[str, Any]) -> None:
        if self._file is None:
            raise RuntimeError("SampleStore.open() first")
        line = json.dumps(record, ensure_ascii=False, default=str)
        self._file.write(line + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.records[key_of(record)] = light(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> SampleStore:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_run_meta(
    out_dir: str | Path, model: str, settings: Mapping[str, Mapping[str, Any]]
) -> None:
    """Record each benchmark's ``settings`` for ``model``; refuse a resume whose settings differ.

    ``settings`` maps benchmark name -> what changes a sample (sampling, env kwargs, dataset);
    only benchmarks already evaluated for this model in this folder are compared.
    """
    path = Path(out_dir) / RUN_META
    meta: dict[str, Any] = {}
    if path.exists():
        try:
            meta = json.loads(path.read_text())
        except json.JSONDecodeError:
            meta = {}
    recorded = meta.setdefault("models", {}).setdefault(model, {})
    problems = []
    for benchmark, values in settings.items():
        current = json.loads(json.dumps(dict(values), default=str))
        previous = recorded.get(benchmark)
        if previous is not None and previous != current:
            diff = sorted(k for k in set(previous) | set(current) if previous.get(k) != current.get(k))
            shown = ", ".join(f"{k}: {previous.get(k)!r} -> {current.get(k)!r}" for k in diff)
            problems.append(f"{benchmark} ({shown})")
        recorded[benchmark] = current
    if problems:
        raise ConfigError(
            f"{path.parent} already holds samples of {model!r} drawn with other settings: "
            f"{'; '.join(problems)}; resume with the same settings or choose another --out"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True))
    os.replace(tmp, path)


__all__ = [
    "RUN_META",
    "SAMPLES",
    "SampleKey",
    "SampleStore",
    "check_run_meta",
    "find_record",
    "key_of",
    "light",
    "read_records",
]

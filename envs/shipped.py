"""Find and read the data files shipped with palaestra (``data/`` in the repository).

The folder is located, in order, from ``$PALAESTRA_DATA_DIR``, next to the installed package
(``palaestra/data`` in a wheel) or at the repository root (editable installs, where
``palaestra.envs`` is a link to ``<repo>/envs``). Files are JSON lines, optionally gzipped.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from palaestra.errors import ConfigError


def data_dir() -> Path:
    """The folder holding the shipped data (``search/``, ``math/``, ``code/``)."""
    override = os.environ.get("PALAESTRA_DATA_DIR")
    candidates = [Path(override)] if override else []
    here = Path(__file__)
    candidates += [
        here.parent.parent / "data",  # wheel: palaestra/envs/shipped.py -> palaestra/data
        here.resolve().parent.parent / "data",  # editable: <repo>/envs/shipped.py -> <repo>/data
    ]
    for candidate in candidates:
        if (candidate / "search").is_dir() or (candidate / "math").is_dir():
            return candidate
    raise ConfigError(
        "cannot find palaestra's shipped data folder (looked in "
        f"{', '.join(str(c) for c in candidates)}); set PALAESTRA_DATA_DIR to the repository's "
        "data/ folder, or reinstall palaestra"
    )


def shipped_path(relative: str) -> Path:
    """Absolute path of a shipped file, e.g. ``shipped_path("math/gsm8k_test.jsonl.gz")``."""
    path = data_dir() / relative
    if not path.exists():
        raise ConfigError(f"shipped data file {relative!r} is missing from {data_dir()}")
    return path


def iter_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """Rows of a JSON-lines file (``.gz`` is decompressed); a bad line names its number."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"data file {str(path)!r} does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:  # type: ignore[operator]
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{number} is not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{number} must be a JSON object, got {type(row).__name__}")
            yield row


@functools.lru_cache(maxsize=16)
def _cached_rows(path: str) -> tuple[dict[str, Any], ...]:
    return tuple(iter_jsonl(path))


def load_rows(source: str | Path, named: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Rows from a shipped dataset name (a key of ``named``) or a JSONL path; cached per process.

    The rows are fresh dict copies, so callers may modify them.
    """
    named = named or {}
    if isinstance(source, str) and source in named:
        path = shipped_path(named[source])
    else:
        path = Path(source)
        if not path.exists():
            known = ", ".join(sorted(named)) or "(none)"
            raise ConfigError(
                f"unknown dataset {str(source)!r}: use one of the shipped datasets ({known}) or "
                "the path of a JSON-lines file"
            )
    return [dict(r) for r in _cached_rows(str(path.resolve()))]

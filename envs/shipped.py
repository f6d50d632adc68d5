"""Find and read the data files shipped with palaestra (``data/`` in the repository).

The folder is ``$PALAESTRA_DATA_DIR`` when set, else the package data ``palaestra/data`` read
through `importlib.resources` (in a wheel the folder itself; in an editable install the
``src/palaestra/data`` link to ``<repo>/data``, as for the component folders). Files are JSON
lines, optionally gzipped.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from palaestra.errors import ConfigError


def data_dir() -> Path:
    """The folder holding the shipped data (``search/``, ``math/``, ``code/``)."""
    override = os.environ.get("PALAESTRA_DATA_DIR")
    # an installed package is a plain folder (wheel or editable path), so the resource is a path
    candidate = Path(override) if override else Path(str(resources.files("palaestra") / "data"))
    if (candidate / "search").is_dir() or (candidate / "math").is_dir():
        return candidate
    raise ConfigError(
        f"cannot find palaestra's shipped data folder (looked in {candidate}); set "
        "PALAESTRA_DATA_DIR to the repository's data/ folder, or reinstall palaestra"
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
    from palaestra.jsonl import jsonl_lines

    for number, row, error in jsonl_lines(path):  # lazily: callers may read the first rows only
        if error is not None:
            raise ConfigError(f"{path}:{number}: {error}")
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

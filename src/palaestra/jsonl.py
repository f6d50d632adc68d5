"""The one JSON-lines reader of the tree: task files, datasets, run logs, tool caches.

`jsonl_lines` yields ``(line number, value, None)`` per non-blank line, or ``(number, None,
why)`` for a line that does not parse, so a caller can name every bad line (the load-time row
checks do); `read_jsonl` is the plain read: a bad line raises `ConfigError` naming
``path:line`` (as editors jump to it), or, with ``bad="stop"``, ends the read there (a log whose
last line a crash cut off). A ``.gz`` file is decompressed on the way.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Literal

from palaestra.errors import ConfigError


def _open(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def jsonl_lines(path: str | Path) -> Iterator[tuple[int, Any, str | None]]:
    """``(line number, value, None)`` per non-blank line, or ``(number, None, why)`` when it
    does not parse."""
    with _open(Path(path)) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line), None
            except json.JSONDecodeError as exc:
                yield n, None, f"not valid JSON ({exc.msg} at column {exc.colno})"


def read_jsonl(
    path: str | Path, *, bad: Literal["raise", "stop"] = "raise", objects: bool = False
) -> list[Any]:
    """The values of a JSON-lines file, blank lines skipped.

    ``bad="raise"``: a line that does not parse raises `ConfigError` (``path:line``);
    ``"stop"``: the read ends before it. ``objects``: every value must be a JSON object.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{str(p)!r} does not exist (or is not a file); check the path")
    rows: list[Any] = []
    for n, value, error in jsonl_lines(p):
        if error is not None:
            if bad == "stop":
                break
            raise ConfigError(f"{p}:{n}: {error}")
        if objects and not isinstance(value, dict):
            raise ConfigError(f"{p}:{n}: must be a JSON object, got {type(value).__name__}")
        rows.append(value)
    return rows


__all__ = ["jsonl_lines", "read_jsonl"]

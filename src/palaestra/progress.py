"""Progress bars that read well in a terminal and in a log file.

In a terminal, `progress_bar` is tqdm's bar (redrawn in place). When the output is a file or a
pipe (``palaestra train ... > log``, CI, a Ray job's log), a redrawn bar writes every redraw into
the file; there it is a `LineProgress` instead, which prints one plain line now and then: at
every tenth of the work, at most every ``interval_s`` seconds otherwise, and at the end.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol, TextIO


class Bar(Protocol):
    """What the phases call on a progress bar (tqdm's surface, the part we use)."""

    def write(self, line: str) -> None: ...
    def set_postfix(self, refresh: bool = True, **values: Any) -> None: ...
    def update(self, n: int = 1) -> object: ...
    def close(self) -> None: ...


class LineProgress:
    """A progress bar for non-terminals: ``desc: 40/400 steps (10%), 12.3 s, loss=0.412``.

    A line is printed when the count crosses a tenth of ``total``, when ``interval_s`` passed
    since the last line, and once at `close` (if the last count was not printed yet).
    """

    def __init__(self, total: int, *, initial: int = 0, desc: str = "", unit: str = "it",
                 interval_s: float = 30.0, stream: TextIO | None = None,
                 clock: Any = time.monotonic) -> None:
        self.total = max(int(total), 0)
        self.n = int(initial)
        self.desc = desc
        self.unit = unit
        self.interval_s = float(interval_s)
        self._stream = stream
        self._clock = clock
        self._started = clock()
        self._last_line_at = self._started
        self._printed_n: int | None = None
        self._postfix: dict[str, Any] = {}

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def write(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        del refresh  # a line is printed on the next due update, never on a postfix change
        self._postfix = values

    def update(self, n: int = 1) -> None:
        before = self.n
        self.n += int(n)
        now = self._clock()
        if self._crossed_a_tenth(before) or now - self._last_line_at >= self.interval_s:
            self._print(now)

    def close(self) -> None:
        if self._printed_n != self.n and self.n > 0:
            self._print(self._clock())

    def _crossed_a_tenth(self, before: int) -> bool:
        if self.total <= 0:
            return False
        return (self.n * 10) // self.total > (before * 10) // self.total

    def _print(self, now: float) -> None:
        self._last_line_at = now
        self._printed_n = self.n
        share = f" ({100 * self.n // self.total}%)" if self.total else ""
        extras = "".join(f", {k}={v}" for k, v in self._postfix.items())
        prefix = f"{self.desc}: " if self.desc else ""
        self.write(f"{prefix}{self.n}/{self.total} {self.unit}s{share}, "
                   f"{now - self._started:.1f} s{extras}")


def progress_bar(total: int, *, initial: int = 0, desc: str = "", unit: str = "it",
                 stream: TextIO | None = None) -> Bar:
    """tqdm's bar on a terminal, else a `LineProgress` (a line every tenth or 30 s)."""
    out = stream if stream is not None else sys.stderr
    if out.isatty():
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True,
                    file=out)
    return LineProgress(total, initial=initial, desc=desc, unit=unit, stream=out)


__all__ = ["Bar", "LineProgress", "progress_bar"]

"""``ExecResult``: what one sandboxed execution produced.

A failing *program* is a normal result (non-zero ``exit_code``, ``timed_out``, ``oom_killed``);
a failing *sandbox* (crashed worker, engine gone) is also a result, with ``error`` set, so an
episode never dies from an exception raised by the sandbox.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

#: Exit status of a run whose sandbox failed before or around the program (no real status).
SANDBOX_ERROR_EXIT = -1


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one run.

    ``exit_code`` follows the shell convention: ``128 + N`` when the program was killed by
    signal N (137 = SIGKILL, e.g. after a timeout or a memory kill), -1 when the sandbox itself
    failed (see ``error``). ``stdout``/``stderr`` are decoded as UTF-8 with replacement
    characters and cut at the configured cap with a visible marker (``truncated`` is then True).
    ``duration_s`` is the program's wall time from start to exit.
    """

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool = False
    duration_s: float = 0.0
    oom_killed: bool = False
    error: str | None = None
    truncated: bool = False
    cpu_s: float | None = None
    max_rss_mb: float | None = None

    @property
    def ok(self) -> bool:
        """True when the program ran to completion with exit status 0."""
        return self.exit_code == 0 and not self.timed_out and self.error is None

    @property
    def signal(self) -> int | None:
        """The signal that ended the program, if any (from the shell-style exit code)."""
        if self.exit_code > 128 and self.error is None:
            return self.exit_code - 128
        return None

    def summary(self) -> str:
        """One line for logs and tool messages: exit status and the reason it ended."""
        if self.error:
            return f"sandbox error: {self.error}"
        if self.timed_out:
            return f"timed out after {self.duration_s:.2f}s"
        if self.oom_killed:
            return "killed: memory limit exceeded"
        sig = self.signal
        if sig is not None:
            try:
                name = signal.Signals(sig).name
            except ValueError:
                name = f"signal {sig}"
            return f"killed by {name} (exit {self.exit_code})"
        return f"exit {self.exit_code}"

    @classmethod
    def failure(cls, message: str, duration_s: float = 0.0) -> ExecResult:
        """A result for a sandbox-level failure (the program may not have run at all)."""
        return cls(stdout="", stderr=f"sandbox error: {message}\n",
                   exit_code=SANDBOX_ERROR_EXIT, duration_s=duration_s, error=message)


def truncation_marker(omitted: int, total: int) -> str:
    """The text appended where output was cut."""
    return f"\n[palaestra: output truncated, {omitted} of {total} bytes omitted]\n"


def decode_output(data: bytes, total: int) -> tuple[str, bool]:
    """Decode captured bytes (UTF-8, replacement characters) and mark truncation."""
    text = data.decode("utf-8", errors="replace")
    if total > len(data):
        return text + truncation_marker(total - len(data), total), True
    return text, False

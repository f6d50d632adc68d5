"""Run hidden tests against a solution in the sandbox and read the verdict safely.

The harness program (``harness.py`` next to this file) runs in a fresh sandbox run, separate
from any run the agent made, in a working directory of its own even when the agent's sandbox is
stateful (``palaestra.sandbox.integrity.judge_run``: nothing the agent left there, such as an
``ast.py`` the judge would import, reaches it); the tests and a one-time nonce go to it on stdin.
The verdict counts only if the run exited 0 without timing out and its stdout holds the result
line with this run's nonce, so output the solution prints (or fakes) cannot set the reward.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from palaestra.envs.code.tasks import CodeTask
from palaestra.envs.python_tool import run_python_program
from palaestra.sandbox.base import Sandbox, SandboxSession
from palaestra.sandbox.integrity import judge_run

RESULT_MARKER = "@@palaestra-result"
HARNESS_SOURCE_PATH = Path(__file__).with_name("harness.py")


@dataclass(frozen=True)
class GradeResult:
    """Tests passed out of total; ``error`` says why the harness gave no verdict."""

    passed: int
    total: int
    failures: tuple[str, ...] = ()
    error: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def all_passed(self) -> bool:
        return self.error is None and self.total > 0 and self.passed == self.total

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def harness_program() -> str:
    """The program sent to the sandbox: the harness source and the line that runs it."""
    source = HARNESS_SOURCE_PATH.read_text(encoding="utf-8")
    return f"HARNESS_SOURCE = {source!r}\nexec(compile(HARNESS_SOURCE, 'harness.py', 'exec'))\n"


def parse_verdict(stdout: str, nonce: str, n_tests: int) -> GradeResult:
    """The one result line carrying ``nonce``, or a failed grade saying why.

    The harness prints exactly one such line; a second one (something else learnt the nonce and
    wrote to the judge's stdout) voids the verdict instead of choosing between them.
    """
    lines = [line for line in stdout.splitlines() if line.startswith(f"{RESULT_MARKER} {nonce} ")]
    if len(lines) != 1:
        why = "no verdict" if not lines else f"{len(lines)} verdicts"
        return GradeResult(0, n_tests, error=f"the harness gave {why}")
    try:
        data = json.loads(lines[0].split(" ", 2)[2])
        passed, total = int(data["passed"]), int(data["total"])
        failures = tuple(str(f) for f in data.get("failures", []))[:3]
    except (ValueError, KeyError, TypeError, AttributeError):
        return GradeResult(0, n_tests, error="the harness gave an unreadable verdict")
    total = max(total, n_tests)  # never fewer tests than the task has
    return GradeResult(max(0, min(passed, total)), total, failures)


async def grade(code: str, task: CodeTask, *, sandbox: Any = None, timeout_s: float = 10.0) -> GradeResult:
    """Run ``task``'s hidden tests on ``code`` in the sandbox."""
    nonce = secrets.token_hex(16)
    spec = dict(task.spec, nonce=nonce, budget_s=timeout_s, n_tests=task.n_tests)
    program, stdin = harness_program(), json.dumps(spec)
    files = {"solution.py": task.program(code).encode("utf-8")}
    budget = timeout_s + 5.0  # the harness stops itself at timeout_s
    if isinstance(sandbox, (Sandbox, SandboxSession)):  # maybe the agent's own, stateful one
        result = await judge_run(sandbox, program, timeout=budget, stdin=stdin, files=files)
    else:  # None, a class or a factory: a sandbox of its own for this run
        result = await run_python_program(sandbox, program, timeout_s=budget, stdin=stdin,
                                          files=files)
    if getattr(result, "error", None):
        return GradeResult(0, task.n_tests, error=f"sandbox error: {result.error}")
    if result.timed_out:
        return GradeResult(0, task.n_tests, error="the tests timed out")
    if result.exit_code != 0:
        tail = (result.stderr or "")[-300:]
        return GradeResult(0, task.n_tests, error=f"the harness exited {result.exit_code}: {tail}")
    return parse_verdict(result.stdout, nonce, task.n_tests)

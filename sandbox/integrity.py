"""Reward integrity: judge an agent's program so that nothing the agent wrote can set its reward.

Rules the helpers enforce:

* The judge runs in a fresh working directory the agent never touched: only the *declared*
  output (the program text, passed in explicitly, e.g. read with ``session.read_file``) is
  copied there. Files the agent left in its workspace (``reward.txt``, fake tests,
  ``sitecustomize.py``, a ``json.py`` shadowing the standard library, ...) do not exist for it.
* Expected answers never enter the sandbox; the comparison happens here, on the host, against
  values parsed from the program's output. Exiting early with status 0, printing "PASSED",
  or patching the harness cannot produce the right values without solving the task.
* One run per case (a crash or hang fails that case only); the reward is ``passed / total``,
  validated to be a finite number in [0, 1].
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from palaestra.errors import SandboxError
from palaestra.sandbox.base import Sandbox
from palaestra.sandbox.result import ExecResult

SOLUTION_FILE = "solution.py"
_HARNESS = """\
import importlib.util, json, sys
_args = json.loads(sys.stdin.read())
_spec = importlib.util.spec_from_file_location("solution", {path!r})
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
_value = getattr(_mod, {func!r})(*_args)
sys.stdout.write("\\n" + {nonce!r} + json.dumps(_value) + "\\n")
sys.stdout.flush()
"""


@dataclass(frozen=True)
class IOCase:
    """One stdin -> expected stdout case (compared line by line, trailing spaces ignored)."""

    stdin: str
    expected_stdout: str


@dataclass(frozen=True)
class CaseVerdict:
    passed: bool
    reason: str
    result: ExecResult | None = None


@dataclass(frozen=True)
class JudgeResult:
    """Verdict over all cases; ``reward`` is the fraction passed."""

    passed: int
    total: int
    cases: tuple[CaseVerdict, ...] = field(default_factory=tuple)

    @property
    def reward(self) -> float:
        value = self.passed / self.total if self.total else 0.0
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):  # defensive: never trust a sum
            raise SandboxError(f"invalid reward {value!r}")
        return value

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total


def _normalise(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _as_json(value: Any) -> Any:
    """Expected values as they look after a JSON round trip (tuples -> lists, ...)."""
    return json.loads(json.dumps(value))


async def judge_io(sandbox: Sandbox, program: str, cases: Sequence[IOCase], *,
                   timeout: float = 5.0) -> JudgeResult:
    """Run ``program`` (python source) on each case's stdin; compare stdout on the host."""
    if not cases:
        raise SandboxError("judge_io needs at least one case")

    async def one(case: IOCase) -> CaseVerdict:
        # A fresh run each time whose working directory holds nothing but the program.
        res = await sandbox.run(program, timeout=timeout, stdin=case.stdin)
        if res.error or res.timed_out or res.exit_code != 0:
            return CaseVerdict(False, res.summary(), res)
        if res.truncated:
            return CaseVerdict(False, "output truncated", res)
        ok = _normalise(res.stdout) == _normalise(case.expected_stdout)
        return CaseVerdict(ok, "ok" if ok else "wrong answer", res)

    verdicts = await asyncio.gather(*(one(c) for c in cases))
    return JudgeResult(sum(v.passed for v in verdicts), len(verdicts), tuple(verdicts))


async def judge_function(sandbox: Sandbox, source: str, func_name: str,
                         cases: Sequence[tuple[Sequence[Any], Any]], *, timeout: float = 5.0,
                         float_tol: float = 1e-9) -> JudgeResult:
    """Call ``func_name`` from ``source`` on each case's arguments; compare return values here.

    Arguments and return values must be JSON-serialisable. The expected values stay on the
    host; the program's output is only trusted on the line carrying a per-run random nonce.
    """
    if not func_name.isidentifier():
        raise SandboxError(f"func_name must be a python identifier, got {func_name!r}")
    if not cases:
        raise SandboxError("judge_function needs at least one case")

    async def one(args: Sequence[Any], expected: Any) -> CaseVerdict:
        nonce = f"@@palaestra-result-{secrets.token_hex(16)}@@"
        harness = _HARNESS.format(path=SOLUTION_FILE, func=func_name, nonce=nonce)
        res = await sandbox.run(harness, timeout=timeout, stdin=json.dumps(list(args)),
                                files={SOLUTION_FILE: source})
        if res.error or res.timed_out:
            return CaseVerdict(False, res.summary(), res)
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith(nonce)]
        if res.exit_code != 0 or len(lines) != 1:
            return CaseVerdict(False, f"no result ({res.summary()})", res)
        try:
            got = json.loads(lines[0][len(nonce):])
        except ValueError:
            return CaseVerdict(False, "unparseable result", res)
        ok = _equal(got, _as_json(expected), float_tol)
        return CaseVerdict(ok, "ok" if ok else "wrong answer", res)

    verdicts = await asyncio.gather(*(one(a, e) for a, e in cases))
    return JudgeResult(sum(v.passed for v in verdicts), len(verdicts), tuple(verdicts))


def _equal(got: Any, expected: Any, tol: float) -> bool:
    if isinstance(expected, float) and isinstance(got, (int, float)) \
            and not isinstance(got, bool):
        return math.isclose(got, expected, rel_tol=tol, abs_tol=tol)
    if isinstance(expected, list) and isinstance(got, list):
        return len(got) == len(expected) and all(_equal(g, e, tol) for g, e in zip(got, expected))
    if isinstance(expected, dict) and isinstance(got, dict):
        return got.keys() == expected.keys() and all(_equal(got[k], expected[k], tol)
                                                     for k in expected)
    return type(got) is type(expected) and got == expected

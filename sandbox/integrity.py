"""Reward integrity: a grader's run never shares a working directory with the agent it grades.

An agent with a stateful sandbox (``Sandbox(stateful=True)``, a session) can leave files in its
workspace that a judge run there would import or trust: an ``ast.py`` that the judge imports
before its tests, reads the test spec (and its one-time nonce) from stdin and prints a forged
verdict; a ``sitecustomize.py``; a ``reward.txt``. ``judge_run`` runs the grader's program in
a fresh working directory holding only the files the grader declares, whatever kind of sandbox
the agent was given. What the judge itself must do (keep the solution in another process, keep
expected values or the nonce out of its reach) is the grader's part: see
``palaestra.envs.code.harness``.
"""

from __future__ import annotations

from collections.abc import Mapping

from palaestra.sandbox.base import Sandbox, SandboxSession
from palaestra.sandbox.errors import SandboxError
from palaestra.sandbox.result import ExecResult


async def judge_run(sandbox: Sandbox | SandboxSession, program: str, *, timeout: float,
                    stdin: bytes | str | None = None,
                    files: Mapping[str, bytes | str] | None = None) -> ExecResult:
    """Run the python ``program`` of a grader in a fresh working directory of ``sandbox`` (a
    session's sandbox when given a session): the agent's files are not there."""
    if isinstance(sandbox, SandboxSession):
        sandbox = sandbox.sandbox
    if not isinstance(sandbox, Sandbox):
        raise SandboxError(f"judge_run needs a Sandbox or a SandboxSession, got "
                           f"{type(sandbox).__name__}")
    return await sandbox.run_fresh(program, "python", timeout, stdin, files)

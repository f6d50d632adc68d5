"""The ``python`` tool shared by the math and code envs: run a snippet in the sandbox, show output.

The code runs in `palaestra.sandbox` (a fresh isolated working directory per call, no network,
resource limits, wall-clock timeout); the model sees stdout, then stderr, the exit code when it is
not 0, and a note when the run timed out or ran out of memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Union, cast

from palaestra.envs.tools import Tool
from palaestra.errors import MissingExtraError

if TYPE_CHECKING:
    from palaestra.sandbox import ExecResult, Sandbox, SandboxSession

#: where a python run goes: None (a fresh `LocalSandbox` per run), a sandbox class or factory
#: (called, then entered with ``async with``), or an open sandbox or session shared by the caller
SandboxChoice = Union["Sandbox", "SandboxSession", Callable[[], "Sandbox"], None]


def _default_sandbox_class() -> Any:
    try:
        from palaestra.sandbox import LocalSandbox
    except ImportError as exc:
        raise MissingExtraError(
            f"the python tool needs palaestra.sandbox ({exc}); install palaestra with its "
            "sandbox extra: pip install 'palaestra[sandbox]'"
        ) from None
    return LocalSandbox


def format_exec_result(result: Any, timeout_s: float) -> str:
    """What the model sees of an `ExecResult`."""
    parts = []
    if result.stdout:
        parts.append(_text(result.stdout))
    if result.stderr:
        parts.append(f"[stderr]\n{_text(result.stderr)}")
    if result.timed_out:
        parts.append(f"[timed out after {timeout_s:g} s]")
    elif getattr(result, "oom_killed", False):
        parts.append("[killed: out of memory]")
    elif result.exit_code != 0:
        parts.append(f"[exit code {result.exit_code}]")
    return "\n".join(parts) if parts else "[no output]"


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value


async def run_python_program(
    sandbox: SandboxChoice,
    code: str,
    *,
    timeout_s: float,
    stdin: str | bytes | None = None,
    files: dict[str, bytes] | None = None,
) -> ExecResult:
    """Run a python program and return the sandbox's `ExecResult`.

    ``sandbox``: None (a fresh `LocalSandbox` for this run), a sandbox class or factory (called,
    then entered with ``async with``), or an open sandbox instance shared by the caller.
    """
    if sandbox is None:
        sandbox = _default_sandbox_class()
    run = getattr(sandbox, "run", None)
    if isinstance(sandbox, type) or run is None:
        factory = cast("Callable[[], Sandbox]", sandbox)  # a class or factory: no `run` of its own
        async with factory() as box:
            return await box.run(code, language="python", timeout=timeout_s, stdin=stdin, files=files)
    return await run(code, language="python", timeout=timeout_s, stdin=stdin, files=files)


async def run_python(sandbox: SandboxChoice, code: str, timeout_s: float) -> ExecResult:
    """Run the model's snippet (no stdin, no extra files)."""
    return await run_python_program(sandbox, code, timeout_s=timeout_s)


def python_tool(owner: Any, *, timeout_s: float = 10.0) -> Tool:
    """A ``python(code)`` tool whose calls run in ``owner.sandbox`` (None: a LocalSandbox)."""

    async def python(code: str) -> str:
        """Run a Python 3 program in a sandbox and return what it prints (stdout, then stderr).

        Args:
            code: the complete program; print what you want to see. Each call starts fresh (no
                variables survive between calls), without network access.
        """
        result = await run_python(getattr(owner, "sandbox", None), code, timeout_s)
        return format_exec_result(result, timeout_s)

    return Tool.from_function(python)

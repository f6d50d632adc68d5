"""Running an `ExternalAgentEnv` command: in the code sandbox, or as a plain subprocess.

The sandbox (`palaestra.sandbox`) blocks every inet socket, loopback included, so a sandboxed
agent reaches the gateway over a Unix socket: the gateway also listens on one, its folder is
mounted read-only into the sandbox, and ``$PALAESTRA_GATEWAY_UDS`` names it. For Python agents a
``sitecustomize`` shim (put on ``PYTHONPATH``) makes every ``httpx``/``httpx2`` transport connect
through that socket, so an unchanged ``openai.OpenAI()`` client with ``OPENAI_BASE_URL`` works.
Programs in other languages connect to the socket themselves (``curl --unix-socket``).

Environment of the program: ``OPENAI_BASE_URL`` (the session's base URL), ``OPENAI_API_KEY``,
``PALAESTRA_TASK`` (the task as JSON; also in the file ``task.json`` of its working directory),
``PALAESTRA_GATEWAY_UDS`` (sandbox only) and the env's ``env_vars``. The files of the env are
written into the working directory. Outcome: the last non-empty stdout line, parsed as JSON when
it is JSON. A non-zero exit raises `AgentCrashError` with the tail of stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from palaestra.errors import PalaestraError

SHIM_DIR = ".palaestra_shim"
UDS_HOST = "palaestra-gateway"

SHIM = '''"""palaestra: route httpx/httpx2 transports through the gateway's Unix socket."""
import os

_UDS = os.environ.get("PALAESTRA_GATEWAY_UDS")


def _patch(name):
    try:
        module = __import__(name)
    except Exception:
        return
    for cls in (module.HTTPTransport, module.AsyncHTTPTransport):
        original = cls.__init__

        def __init__(self, *args, _original=original, **kwargs):
            if kwargs.get("uds") is None and kwargs.get("proxy") is None:
                kwargs["uds"] = _UDS
            _original(self, *args, **kwargs)

        cls.__init__ = __init__


if _UDS:
    for _name in ("httpx", "httpx2"):
        _patch(_name)
'''


class AgentCrashError(PalaestraError, RuntimeError):
    """The agent program exited with an error."""


def parse_outcome(stdout: str) -> Any:
    """The last non-empty line of the program's output (JSON-decoded when it is JSON)."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        return json.loads(lines[-1])
    except ValueError:
        return lines[-1].strip()


def _python(argv: list[str], sandbox_python: str | None) -> list[str]:
    if argv and argv[0] in ("python", "python3"):
        return [sandbox_python or sys.executable, *argv[1:]]
    return argv


def _tail(text: str, n: int = 1500) -> str:
    return text[-n:].strip()


async def run_in_sandbox(env: Any, *, session_path: str, unix_path: str, task: dict[str, Any],
                         timeout_s: float) -> Any:
    """Run ``env.command`` in a fresh sandbox that can reach the gateway's Unix socket."""
    from palaestra.sandbox import Sandbox

    options = env.sandbox_options
    options["ro_paths"] = (*options.get("ro_paths", ()), os.path.dirname(unix_path))
    options.setdefault("memory_mb", 1024)  # an openai client import needs more than 512 MiB
    task_json = json.dumps(task, default=str)
    variables = {
        "OPENAI_BASE_URL": f"http://{UDS_HOST}{session_path}",
        "OPENAI_API_KEY": env.api_key,
        "PALAESTRA_TASK": task_json,
        "PALAESTRA_GATEWAY_UDS": unix_path,
        "PYTHONPATH": SHIM_DIR,
        **env.env_vars,
    }
    files = {f"{SHIM_DIR}/sitecustomize.py": SHIM, "task.json": task_json, **env.files}
    async with Sandbox(**options) as sandbox:  # type: ignore[abstract]  # __new__ picks the backend
        argv = ["env", *(f"{k}={v}" for k, v in variables.items()),
                *_python(env.command, sandbox.config.python)]
        result = await sandbox.run_command(argv, timeout=timeout_s, files=files)
    if result.timed_out:
        raise TimeoutError(f"the agent command did not finish within {timeout_s} s")
    if result.error is not None:
        raise AgentCrashError(f"the sandbox failed: {result.error}")
    if result.exit_code != 0:
        raise AgentCrashError(
            f"the agent command exited with {result.exit_code}: {_tail(result.stderr)}")
    return parse_outcome(result.stdout)


async def run_subprocess(env: Any, *, base_url: str, task: dict[str, Any],
                         timeout_s: float) -> Any:
    """Run ``env.command`` as a plain subprocess (trusted agents; ``sandbox=False``)."""
    task_json = json.dumps(task, default=str)
    workdir = Path(tempfile.mkdtemp(prefix="palaestra-agent-"))
    try:
        for name, data in {"task.json": task_json, **env.files}.items():
            path = workdir / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data.encode() if isinstance(data, str) else data)
        variables = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(workdir),
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": env.api_key,
            "PALAESTRA_TASK": task_json,
            **env.env_vars,
        }
        proc = await asyncio.create_subprocess_exec(
            *_python(env.command, None), cwd=workdir, env=variables,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proc.wait(), 5.0)
            raise
        if proc.returncode != 0:
            raise AgentCrashError(f"the agent command exited with {proc.returncode}: "
                                  f"{_tail(err.decode(errors='replace'))}")
        return parse_outcome(out.decode(errors="replace"))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


__all__ = ["SHIM", "AgentCrashError", "parse_outcome", "run_in_sandbox", "run_subprocess"]

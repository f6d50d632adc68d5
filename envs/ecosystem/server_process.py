"""How a stdio tool server is launched: the sandbox's walls around one long-lived process.

`palaestra.sandbox` runs programs to completion (``run``/``run_command``, sessions whose calls
each end before they return); nothing a call starts outlives it, and there is no API to keep a
process with open stdin/stdout pipes across calls. An MCP stdio server is exactly such a process
(one JSON-RPC conversation over its pipes for a whole episode), so it is started here with the
same walls the local sandbox builds for its workers: bubblewrap (`palaestra.sandbox.isolation`:
no network, a read-only view of the system directories and the interpreter, a curated /etc, a
private tmpfs as working directory), inside it a tiny launcher that sets rlimits (address space,
CPU time, open files, file size) and replaces the environment with a clean one before it execs
the server. The files the command names (``python path/to/server.py``) are bound read-only and
passed by absolute path, so a command works as written. Without bubblewrap the caller must opt
out explicitly (``sandbox=False``: same launcher, limits and clean environment, on the host).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from palaestra.errors import ConfigError, SandboxError

#: Working directory of a sandboxed server (a private tmpfs of ``workspace_mb``).
SERVER_WORKDIR = "/sandbox"
MIB = 1024 * 1024

# Runs inside the sandbox with ``python -I -S``: limits, clean environment, then exec the server.
_LAUNCHER = (
    "import json,os,resource,sys\n"
    "spec=json.loads(sys.argv[1])\n"
    "for name,value in spec['limits'].items():\n"
    "    resource.setrlimit(getattr(resource,name),(value,value))\n"
    "os.execve(spec['argv'][0],spec['argv'],spec['env'])\n"
)


@dataclass(frozen=True)
class ServerLimits:
    """Resource limits of one tool-server process (it lives for a whole episode)."""

    memory_mb: int = 2048
    """Address-space cap (RLIMIT_AS), in MiB."""
    cpu_seconds: int = 300
    """CPU time over the server's whole life (RLIMIT_CPU)."""
    max_open_files: int = 256
    """Open file descriptors (RLIMIT_NOFILE)."""
    max_file_size_mb: int = 64
    """Largest file the server may write (RLIMIT_FSIZE)."""
    workspace_mb: int = 64
    """Size of the private tmpfs the sandboxed server runs in."""

    def rlimits(self) -> dict[str, int]:
        return {
            "RLIMIT_AS": self.memory_mb * MIB,
            "RLIMIT_CPU": self.cpu_seconds,
            "RLIMIT_NOFILE": self.max_open_files,
            "RLIMIT_FSIZE": self.max_file_size_mb * MIB,
        }


@dataclass(frozen=True)
class LaunchPlan:
    """The process to spawn: ``executable`` with ``args``, in ``cwd`` (None: inherit)."""

    executable: str
    args: tuple[str, ...]
    cwd: str | None
    sandboxed: bool


def resolve_command(command: Sequence[str]) -> list[str]:
    """``command`` with its program resolved on PATH (``python``: this interpreter) and every
    argument that names an existing file made absolute."""
    if isinstance(command, str) or not command or not all(isinstance(a, str) for a in command):
        raise ConfigError(
            f"command must be a non-empty list of strings, e.g. ['python', 'server.py'], got "
            f"{command!r}"
        )
    program = command[0]
    if program in ("python", "python3", os.path.basename(sys.executable)):
        exe = sys.executable  # the interpreter palaestra runs on, with the mcp SDK installed
    else:
        found = shutil.which(program)
        if found is None:
            raise ConfigError(f"cannot find the server program {program!r} on PATH")
        exe = found
    args = [os.path.abspath(a) if _is_file_arg(a) else a for a in command[1:]]
    return [os.path.abspath(exe), *args]


def _is_file_arg(arg: str) -> bool:
    return not arg.startswith("-") and os.path.isfile(arg)


def plan_launch(
    command: Sequence[str],
    *,
    sandbox: bool,
    limits: ServerLimits,
    env: Mapping[str, str] | None = None,
) -> LaunchPlan:
    """How to start ``command`` as a stdio server (inside bubblewrap when ``sandbox``)."""
    from palaestra.sandbox.isolation import clean_env

    argv = resolve_command(command)
    exe_dir = os.path.dirname(sys.executable)
    child_env = clean_env({"PATH": f"{exe_dir}:/usr/local/bin:/usr/bin:/bin"})
    child_env.update(dict(env or {}))
    spec = json.dumps({"limits": limits.rlimits(), "argv": argv, "env": child_env})
    launcher = [sys.executable, "-I", "-S", "-c", _LAUNCHER, spec]
    if not sandbox:
        return LaunchPlan(launcher[0], tuple(launcher[1:]), None, sandboxed=False)
    prefix = _bwrap_prefix(argv, limits)
    return LaunchPlan(prefix[0], tuple(prefix[1:] + launcher), None, sandboxed=True)


def _bwrap_prefix(argv: Sequence[str], limits: ServerLimits) -> list[str]:
    from palaestra.sandbox.probe import probe_isolation
    from palaestra.sandbox.isolation import bwrap_argv, python_layout

    report = probe_isolation()
    if not report.bwrap:
        raise SandboxError(
            "the tool server cannot be sandboxed here: bubblewrap does not work "
            f"({'; '.join(report.notes) or 'not installed'}). Install it (apt-get install "
            "bubblewrap, or bash scripts/setup.sh as root), or pass sandbox=False to run the "
            "server unisolated (clean environment and resource limits only)."
        )
    layout = python_layout()
    # The program and the files named in the command, read-only (their folders, so a server
    # can import its sibling modules).
    extra = sorted({os.path.dirname(a) for a in argv if os.path.isfile(a)})
    return bwrap_argv(report.bwrap, layout, SERVER_WORKDIR, extra, (), limits.workspace_mb,
                      chdir=SERVER_WORKDIR)

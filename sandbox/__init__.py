"""Isolated code execution for agents: ``Sandbox`` (local or Docker), results, limits, probes.

Light to import: the Docker SDK loads only when used. Both backends (`LocalSandbox`,
`DockerSandbox`) are imported here, which registers them with `Sandbox` (``Sandbox(backend=
"docker")`` picks the class by name).

    from palaestra.sandbox import Sandbox
    async with Sandbox() as sb:
        r = await sb.run("print(6 * 7)")
        assert r.stdout == "42\n"
"""

from __future__ import annotations

from palaestra.sandbox.base import Sandbox, SandboxSession
from palaestra.sandbox.config import DEFAULT_IMAGE, SandboxConfig
from palaestra.sandbox.docker_backend import DockerSandbox
from palaestra.sandbox.errors import IsolationUnavailableError, SandboxError, SandboxFileError
from palaestra.sandbox.integrity import judge_run
from palaestra.sandbox.limiter import ExecLimiter
from palaestra.sandbox.local import LocalSandbox
from palaestra.sandbox.probe import IsolationReport, probe_isolation
from palaestra.sandbox.result import ExecResult
from palaestra.sandbox.spec import LANGUAGES

__all__ = [
    "DEFAULT_IMAGE",
    "DockerSandbox",
    "ExecLimiter",
    "ExecResult",
    "IsolationReport",
    "IsolationUnavailableError",
    "LANGUAGES",
    "LocalSandbox",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "SandboxFileError",
    "SandboxSession",
    "judge_run",
    "probe_isolation",
]

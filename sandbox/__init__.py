"""Isolated code execution for agents: ``Sandbox`` (local or Docker), results, limits, probes.

Light to import: the Docker SDK loads only when used. Both backends (`LocalSandbox`,
`DockerSandbox`) are imported here, which registers them with `Sandbox` (``Sandbox(backend=
"docker")`` picks the class by name).

    from palaestra.sandbox import Sandbox
    async with Sandbox() as sb:
        r = await sb.run("print(6 * 7)")
        assert r.stdout == "42\\n"
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from palaestra.sandbox.base import Sandbox, SandboxSession
from palaestra.sandbox.config import DEFAULT_IMAGE, SandboxConfig
from palaestra.sandbox.docker_backend import DockerSandbox
from palaestra.sandbox.errors import IsolationUnavailableError, SandboxError, SandboxFileError
from palaestra.sandbox.limiter import ExecLimiter
from palaestra.sandbox.local import LocalSandbox
from palaestra.sandbox.result import ExecResult
from palaestra.sandbox.spec import LANGUAGES

if TYPE_CHECKING:
    from palaestra.sandbox.integrity import judge_run
    from palaestra.sandbox.probe import IsolationReport

_LAZY = {
    "probe_isolation": "palaestra.sandbox.probe",
    "IsolationReport": "palaestra.sandbox.probe",
    "judge_run": "palaestra.sandbox.integrity",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'palaestra.sandbox' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def probe_isolation() -> IsolationReport:
    """Which isolation layers work on this machine (cached; see ``palaestra sandbox doctor``)."""
    from palaestra.sandbox.probe import probe_isolation as _probe

    return _probe()


__all__ = [
    "DEFAULT_IMAGE",
    "LANGUAGES",
    "DockerSandbox",
    "ExecLimiter",
    "ExecResult",
    "IsolationReport",
    "IsolationUnavailableError",
    "LocalSandbox",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "SandboxFileError",
    "SandboxSession",
    "judge_run",
    "probe_isolation",
]

"""Environments from the ecosystem as palaestra envs: MCP tool servers, verifiers, OpenEnv.

- `MCPEnv` (``palaestra/MCP-v0``): the tools of an MCP server (stdio, sandboxed; or streamable
  HTTP) with user tasks and reward; `NotesEnv` (``palaestra/MCPNotes-v0``) the shipped example.
- `VerifiersEnv`: an installed verifiers environment (dataset, multi-turn protocol, rubric).
- `OpenEnvEnv`: an OpenEnv HTTP environment server (reset/step/state).

Light to import: the SDKs (``mcp``, ``verifiers``, ``openenv-core``) load when an env starts.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the lazy exports for type checkers; at run time `__getattr__` loads them
    from palaestra.envs.ecosystem.mcp_client import (
        CallOutcome as CallOutcome,
    )
    from palaestra.envs.ecosystem.mcp_client import (
        MCPConnection as MCPConnection,
    )
    from palaestra.envs.ecosystem.mcp_env import (
        MCPEnv as MCPEnv,
    )
    from palaestra.envs.ecosystem.mcp_env import (
        MCPEpisode as MCPEpisode,
    )
    from palaestra.envs.ecosystem.notes import (
        NotesEnv as NotesEnv,
    )
    from palaestra.envs.ecosystem.openenv_env import (
        OpenEnvEnv as OpenEnvEnv,
    )
    from palaestra.envs.ecosystem.server_process import (
        ServerLimits as ServerLimits,
    )
    from palaestra.envs.ecosystem.verifiers_env import (
        VerifiersEnv as VerifiersEnv,
    )

_LAZY = {
    "MCPEnv": "palaestra.envs.ecosystem.mcp_env",
    "MCPEpisode": "palaestra.envs.ecosystem.mcp_env",
    "MCPConnection": "palaestra.envs.ecosystem.mcp_client",
    "CallOutcome": "palaestra.envs.ecosystem.mcp_client",
    "ServerLimits": "palaestra.envs.ecosystem.server_process",
    "NotesEnv": "palaestra.envs.ecosystem.notes",
    "VerifiersEnv": "palaestra.envs.ecosystem.verifiers_env",
    "OpenEnvEnv": "palaestra.envs.ecosystem.openenv_env",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'palaestra.envs.ecosystem' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


#: Adapters that need arguments (a server URL, an environment id): registered outside the
#: ``palaestra/`` namespace, so the registry-wide checks (which build envs without arguments)
#: leave them out; ``make("palaestra.envs.ecosystem:ecosystem/OpenEnv-v0", url=...)``.
ECOSYSTEM_ENVS: dict[str, str] = {
    "ecosystem/OpenEnv-v0": "palaestra.envs.ecosystem.openenv_env:OpenEnvEnv",
    "ecosystem/Verifiers-v0": "palaestra.envs.ecosystem.verifiers_env:verifiers_env",
}


def register_ecosystem() -> None:
    """Register the adapters (string entry points: nothing is imported)."""
    from palaestra.envs.registry import register

    for env_id, entry_point in ECOSYSTEM_ENVS.items():
        register(env_id, entry_point)


register_ecosystem()  # as palaestra.envs registers its built-ins: make("module:id") imports us

__all__ = ["ECOSYSTEM_ENVS", "CallOutcome", "MCPConnection", "MCPEnv", "MCPEpisode", "NotesEnv", "OpenEnvEnv", "ServerLimits", "VerifiersEnv", "register_ecosystem"]

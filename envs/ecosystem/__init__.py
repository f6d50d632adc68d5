"""Environments from the ecosystem as palaestra envs: MCP tool servers, verifiers, OpenEnv.

- `MCPEnv` (``palaestra/MCP-v0``): the tools of an MCP server (stdio, sandboxed; or streamable
  HTTP) with user tasks and reward; `NotesEnv` (``palaestra/MCPNotes-v0``) the shipped example.
- `VerifiersEnv`: an installed verifiers environment (dataset, multi-turn protocol, rubric).
- `OpenEnvEnv`: an OpenEnv HTTP environment server (reset/step/state).

Light to import: the SDKs (``mcp``, ``verifiers``, ``openenv-core``) load when an env starts.
"""

from __future__ import annotations


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

__all__ = ["ECOSYSTEM_ENVS", "register_ecosystem"]

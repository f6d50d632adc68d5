"""Environment registration through gymnasium's registry, under the ``palaestra/`` namespace.

Built-in envs are registered with string entry points, so their heavy dependencies load only when
`make` runs. Third-party packages register their own envs with `register` (or gymnasium's), and
``make("their.module:Their-v0")`` imports the module first, as gymnasium does.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import gymnasium
from gymnasium.envs.registration import EnvCreator

from palaestra.errors import ConfigError, EnvNotFoundError, MissingExtraError

NAMESPACE = "palaestra"

#: id -> entry point of the built-in environments (kwargs come from `make` or the TOML config).
BUILTIN_ENVS: dict[str, str] = {
    "palaestra/Calculator-v0": "palaestra.envs.calculator:CalculatorEnv",
    "palaestra/HiddenRule-v0": "palaestra.envs.hidden_rule:HiddenRuleEnv",
    "palaestra/SearchR1-v0": "palaestra.envs.search.env:SearchR1Env",
    "palaestra/SearchR1Tools-v0": "palaestra.envs.search.env:SearchR1ToolsEnv",
    "palaestra/GSM8K-v0": "palaestra.envs.math:GSM8KEnv",
    "palaestra/MATH-v0": "palaestra.envs.math:MATHEnv",
    "palaestra/Code-v0": "palaestra.envs.code.env:CodeEnv",
    "palaestra/FrozenLake-v0": "palaestra.envs.toy_text:FrozenLakeTextEnv",
    "palaestra/Taxi-v0": "palaestra.envs.toy_text:TaxiTextEnv",
    "palaestra/CliffWalking-v0": "palaestra.envs.toy_text:CliffWalkingTextEnv",
    "palaestra/Blackjack-v0": "palaestra.envs.toy_text:BlackjackTextEnv",
    "palaestra/MCP-v0": "palaestra.envs.ecosystem.mcp_env:MCPEnv",
    "palaestra/MCPNotes-v0": "palaestra.envs.ecosystem.notes:NotesEnv",
}


def register(env_id: str, entry_point: str | EnvCreator, **kwargs: Any) -> None:
    """Register an env (idempotent for the same entry point). ``kwargs`` become defaults."""
    existing = gymnasium.registry.get(env_id)
    if existing is not None and existing.entry_point == entry_point:
        return
    gymnasium.register(
        env_id,
        entry_point=entry_point,
        kwargs=kwargs,
        disable_env_checker=True,  # palaestra envs are checked by `palaestra envs check`
        order_enforce=False,
    )


def register_verifiers_id(taskset_id: str) -> str:
    """Register ``verifiers/<taskset id>`` (a `VerifiersEnv` of that installed taskset) and
    return it: ``make("verifiers:<taskset id>")`` goes through here (the env module loads only
    when the env is made)."""
    import re

    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", taskset_id or ""):
        raise ConfigError(f"'verifiers:{taskset_id}' is not a verifiers environment id; write "
                          "make('verifiers:<taskset id>'), e.g. 'verifiers:my-taskset' (the "
                          "installed package's name)")
    env_id = "verifiers/" + taskset_id.replace("/", ".")
    register(env_id, "palaestra.envs.ecosystem.verifiers_env:verifiers_env", taskset_id=taskset_id)
    return env_id


def register_builtin() -> None:
    for env_id, entry_point in BUILTIN_ENVS.items():
        register(env_id, entry_point)


def register_declared(module: ModuleType) -> None:
    """Register the ``PALAESTRA_ENVS`` table (id -> entry point) a module declares.

    `lookup` calls it for the module of a ``"some.module:Their-v0"`` id, so such a module
    declares its envs instead of registering them as an import side effect (a module that calls
    `register` at import, gymnasium's way, still works).
    """
    table = getattr(module, "PALAESTRA_ENVS", None)
    if table is None:
        return
    if not isinstance(table, Mapping):
        raise EnvNotFoundError(
            f"{module.__name__}.PALAESTRA_ENVS must map env ids to entry points "
            f"('pkg.module:Class'), got {type(table).__name__}"
        )
    for env_id, entry_point in table.items():
        register(env_id, entry_point)


def lookup(env_id: str) -> tuple[str, Any]:
    """The bare gymnasium id and `EnvSpec` registered as ``env_id``, without building the env.

    ``some.module:Their-v0`` imports ``some.module`` first (it registers its envs). Raises
    `EnvNotFoundError` naming the close matches when the id is not registered.
    """
    register_builtin()
    module, _, bare_id = env_id.rpartition(":")
    if module == "verifiers":  # "verifiers:<taskset id>": an installed verifiers environment
        return lookup(register_verifiers_id(bare_id))
    if module:
        try:
            imported = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            raise EnvNotFoundError(
                f"cannot import {module!r} to find {bare_id!r} ({exc}); is the package installed?"
            ) from None
        register_declared(imported)
    spec = gymnasium.registry.get(bare_id)
    if spec is None:
        close = difflib.get_close_matches(bare_id, list(gymnasium.registry), n=3, cutoff=0.8)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise EnvNotFoundError(
            f"no environment registered as {bare_id!r}.{hint} Did you register it, or import the "
            "package that registers it (make('your.module:YourEnv-v0') imports it for you)? "
            "`palaestra envs list` shows what is registered."
        )
    return bare_id, spec


def make(env_id: str, **kwargs: Any) -> Any:
    """Create an env by id (``palaestra/Calculator-v0`` or ``some.module:Their-v0``).

    Returns the env itself, not wrapped, so the async and snapshot methods stay reachable.
    """
    bare_id, _ = lookup(env_id)
    try:
        env = gymnasium.make(bare_id, **kwargs)
    except ImportError as exc:
        missing = getattr(exc, "name", None) or str(exc)
        raise MissingExtraError(
            f"{bare_id} needs a package that is not installed ({missing}). Install palaestra "
            "with the extra the env's docstring names, e.g. pip install 'palaestra[docker]'"
        ) from exc
    return env.unwrapped


@dataclass(frozen=True)
class EnvInfo:
    """One line of `palaestra envs list`."""

    id: str
    description: str
    tools: tuple[str, ...]
    error: str | None = None


def palaestra_env_ids() -> list[str]:
    """Ids of the built-in envs plus every registered id in the ``palaestra/`` namespace."""
    register_builtin()
    return sorted(i for i, spec in gymnasium.registry.items() if spec.namespace == NAMESPACE)


def describe(env_id: str) -> EnvInfo:
    """Id, first docstring line and tool names of an env (instantiating it, which is cheap)."""
    try:
        env = make(env_id)
    except Exception as exc:  # show unusable envs in the listing with the reason
        return EnvInfo(env_id, "", (), error=f"{type(exc).__name__}: {exc}")
    doc = (type(env).__doc__ or "").strip().splitlines()
    try:  # an adapter discovers its tools from a server, which may fail to start here
        tools = tuple(t["function"]["name"] for t in env.tool_schemas())
    except Exception as exc:
        return EnvInfo(env_id, doc[0] if doc else "", (), error=f"{type(exc).__name__}: {exc}")
    finally:
        env.close()
    return EnvInfo(env_id, doc[0] if doc else "", tools)

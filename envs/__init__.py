"""Environments: the gymnasium API over chat messages, tools, the registry and the built-in envs.

Importing this package registers the built-in envs in gymnasium's registry (string entry points,
nothing heavy is imported), as gymnasium does for its own envs.
"""

from palaestra.envs.external_agent import ExternalAgentEnv
from palaestra.envs.base import Env, MultiTurnEnv, StepResult, task_id_of
from palaestra.envs.games import TextGameEnv, wrap_gymnasium
from palaestra.envs.registry import (
    BUILTIN_ENVS,
    EnvInfo,
    describe,
    make,
    palaestra_env_ids,
    register,
    register_builtin,
)
from palaestra.envs.spaces import AssistantMessageSpace, MessagesSpace
from palaestra.envs.tool_env import ToolEnv
from palaestra.envs.tools import Tool, tool

register_builtin()

__all__ = [
    "BUILTIN_ENVS",
    "ExternalAgentEnv",
    "AssistantMessageSpace",
    "Env",
    "EnvInfo",
    "MessagesSpace",
    "MultiTurnEnv",
    "StepResult",
    "TextGameEnv",
    "Tool",
    "ToolEnv",
    "describe",
    "make",
    "palaestra_env_ids",
    "register",
    "register_builtin",
    "task_id_of",
    "tool",
    "wrap_gymnasium",
]

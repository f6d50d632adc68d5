"""The tool schemas an env offers, read by making the env once (for trainers, which never import
envs: offline SFT puts the env's tools into the demonstrations' prompts)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def env_tool_schemas(env_id: str, env_kwargs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """OpenAI function schemas of env ``env_id`` built with ``env_kwargs`` ([] for a plain env)."""
    from palaestra import envs

    env = envs.make(env_id, **dict(env_kwargs))
    try:
        return list(env.tool_schemas())
    finally:
        env.close()


__all__ = ["env_tool_schemas"]

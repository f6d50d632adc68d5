"""Record/replay of tool results, keyed by (env, task, call), in a JSONL file.

``ToolCache(path, mode)`` runs an env's tool calls through `attach`, which injects a per-env
`CachedTools` as the env's `palaestra.envs.tool_env.ToolRunner` (no env method is replaced):
``record`` runs every call and appends its result; ``replay`` answers only from the file and
raises `ToolCacheMissError` for a call it has not seen (the episode ends with stop reason
``error``, so a diverging replay is visible); ``auto`` replays what it has and records the rest.
The key is (env id, task id, tool name, canonical JSON arguments, occurrence), where occurrence
counts identical calls within the episode, so a stateful tool called twice replays in order.

Several worker processes may record into one file: every entry is one ``write`` of one line on a
file opened with ``O_APPEND``, so lines from different processes never interleave.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from palaestra.envs.base import task_id_of
from palaestra.envs.tool_env import ToolCallFn
from palaestra.errors import ConfigError, ToolError
from palaestra.types import Message, ToolCall

MODES = ("record", "replay", "auto")


class ToolCacheMissError(ToolError):
    """Replay met a tool call that the recording does not contain."""


def _canonical(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"))
    except (json.JSONDecodeError, TypeError):
        return arguments


def cache_key(env_id: str, task_id: str, name: str, arguments: str, occurrence: int) -> str:
    blob = json.dumps([env_id, task_id, name, _canonical(arguments), occurrence])
    return hashlib.sha1(blob.encode()).hexdigest()


class ToolCache:
    """A JSONL store of tool results shared by every env attached to it."""

    def __init__(self, path: str | Path, mode: str = "record") -> None:
        if mode not in MODES:
            raise ConfigError(f"tool cache mode must be one of {MODES}, got {mode!r}")
        self.path = Path(path)
        self.mode = mode
        self.hits = 0
        self.misses = 0
        self.recorded = 0
        self._entries: dict[str, tuple[str, bool]] = {}
        if mode in ("replay", "auto"):
            if mode == "replay" and not self.path.exists():
                raise ConfigError(
                    f"tool cache {str(self.path)!r} does not exist; record it first (mode='record')"
                )
            self._load()
        self._fd: int | None = None

    def _load(self) -> None:
        from palaestra.jsonl import read_jsonl

        if not self.path.exists():
            return
        for entry in read_jsonl(self.path):  # a bad line: ConfigError naming path:line
            self._entries.setdefault(entry["key"], (entry["content"], entry["is_error"]))

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: str) -> tuple[str, bool] | None:
        return self._entries.get(key)

    def record(self, key: str, entry: Mapping[str, Any], content: str, is_error: bool) -> None:
        self._entries.setdefault(key, (content, is_error))
        line = json.dumps({"key": key, **entry, "content": content, "is_error": is_error})
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(self._fd, (line + "\n").encode("utf-8"))
        self.recorded += 1

    def attach(self, env: Any, env_id: str) -> Any:
        """Route ``env``'s tool calls through this cache (returns the same env)."""
        target = getattr(env, "unwrapped", env)
        use = getattr(target, "use_tool_runner", None)
        if not callable(use):
            raise ConfigError(
                f"{type(target).__name__} has no use_tool_runner(runner) method; the tool cache "
                "runs the calls of ToolEnv envs"
            )
        use(CachedTools(self, env_id))
        return env

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "recorded": self.recorded}

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __getstate__(self) -> dict[str, Any]:  # picklable: reopened lazily in the new process
        return {**self.__dict__, "_fd": None}


class CachedTools:
    """One env's `ToolRunner` over a `ToolCache`: the episode's task id and call occurrences."""

    def __init__(self, cache: ToolCache, env_id: str) -> None:
        self.cache = cache
        self.env_id = env_id
        self.task_id = ""
        self.counts: dict[tuple[str, str], int] = {}

    def start_episode(self, task: Mapping[str, Any]) -> None:
        self.task_id = task_id_of(task)
        self.counts.clear()

    async def run(self, call: ToolCall, execute: ToolCallFn) -> tuple[Message, bool]:
        cache = self.cache
        args = _canonical(call.arguments)
        occurrence = self.counts.get((call.name, args), 0)
        self.counts[(call.name, args)] = occurrence + 1
        key = cache_key(self.env_id, self.task_id, call.name, args, occurrence)
        if cache.mode != "record":
            found = cache.lookup(key)
            if found is not None:
                cache.hits += 1
                content, is_error = found
                return _tool_message(call, content), is_error
            cache.misses += 1
            if cache.mode == "replay":
                raise ToolCacheMissError(
                    f"replay: no recorded result for {call.name}({call.arguments}) in task "
                    f"{self.task_id!r} of {self.env_id}; record with mode='record' or use 'auto'"
                )
        message, is_error = await execute(call)
        entry = {
            "env_id": self.env_id,
            "task_id": self.task_id,
            "name": call.name,
            "arguments": args,
            "occurrence": occurrence,
        }
        cache.record(key, entry, message.content, is_error)
        return message, is_error


def _tool_message(call: ToolCall, content: str) -> Message:
    return Message(role="tool", content=content, tool_call_id=call.id or None, name=call.name)


__all__ = ["MODES", "CachedTools", "ToolCache", "ToolCacheMissError", "cache_key"]

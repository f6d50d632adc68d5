"""``palaestra/MCP-v0``: the tools of an MCP server as a palaestra env (``pip install 'palaestra[mcp]'``).

    env = palaestra.envs.make("palaestra/MCP-v0", command=["python", "server.py"],
                              task="Save a note called todo", reward="my_pkg.rewards:todo_saved")
    env = palaestra.envs.make("palaestra/MCP-v0", url="http://127.0.0.1:8000/mcp")

Without ``command`` or ``url`` it serves the shipped example (``examples/mcp_notes/server.py``),
so ``palaestra envs play palaestra/MCP-v0`` and ``palaestra envs check`` work out of the box.

Tools are discovered with the SDK's ``list_tools`` (once per server command or URL in a process:
tool lists are taken to be static) and offered to the model as OpenAI tool schemas (their input
JSON schemas as the parameters). Calls made by the model go to ``call_tool`` in order, one after
another (servers are stateful); text, structured results and ``isError`` become tool messages as
for native tools. One server per episode: started at the first call (or at reset when the task
has ``setup`` calls), kept for the rest of the episode, stopped at the next reset or ``close()``.
A stdio server runs in the sandbox (`server_process`) unless ``sandbox=False``.

A server that crashes or does not answer within ``tool_timeout_s`` gives an error tool message
and ends the episode (stop reason ``error`` or ``timeout``, the reason in ``info["error"]``).

Tasks: rows ``{"prompt": str, ...}`` (or ``"question"``, or ``"messages"``), with optional
``"system"`` and ``"setup": [{"name": tool, "arguments": {...}}]`` (calls made before the model's
first turn, hidden from it). Without tasks the env is free-form: one default prompt. Reward: a
function of the finished `MCPEpisode` (sync or async, or its ``"module:function"`` name), given
the final answer, the conversation and a handle to call the episode's server (to check its
state); without one every reward is 0. Subclasses may override `sample_task` and `reward`.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from palaestra.asyncio_utils import run_sync
from palaestra.envs.base import Env, StepResult
from palaestra.envs.ecosystem.mcp_client import CallOutcome, MCPConnection, tool_schema
from palaestra.envs.ecosystem.server_process import ServerLimits, resolve_command
from palaestra.envs.tool_env import ToolEnv
from palaestra.errors import ConfigError, ToolError
from palaestra.types import Message, StopReason, ToolCall

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant with tools. Call them when they help, then give your final "
    "answer in a message without tool calls."
)
DEFAULT_PROMPT = "Explore the tools you have: call a few of them and summarise what they do."

#: (command or url) -> OpenAI schemas of its tools, discovered once per process.
_SCHEMA_CACHE: dict[tuple[Any, ...], list[dict[str, Any]]] = {}


#: the shipped example MCP server (the notes server), relative to the package root
SERVER_RELATIVE = Path("examples") / "mcp_notes" / "server.py"


def notes_server_path() -> Path:
    """The shipped notes server (next to the package in a wheel, else in the repository)."""
    here = Path(__file__)
    candidates = [
        here.parent.parent.parent / SERVER_RELATIVE,  # wheel: palaestra/examples/mcp_notes
        here.resolve().parent.parent.parent / SERVER_RELATIVE,  # editable: <repo>/examples
    ]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"cannot find the MCP notes example server (looked in {', '.join(map(str, candidates))}); "
        "reinstall palaestra or pass command=['python', 'path/to/server.py']"
    )


@dataclass
class MCPEpisode:
    """What a reward function sees: the task, the conversation, the answer, the live server."""

    task: Mapping[str, Any]
    messages: Sequence[Message]
    answer: str
    env: MCPEnv = field(repr=False)

    @property
    def server_started(self) -> bool:
        """Whether this episode started a server (no tool call and no setup: it did not)."""
        return self.env._connection is not None

    async def call(self, name: str, **arguments: Any) -> CallOutcome:
        """Call a tool of the episode's server (e.g. to read the state the model left)."""
        return await self.env._call(name, arguments)


RewardFn = Callable[[MCPEpisode], "float | Awaitable[float]"]


class MCPEnv(ToolEnv):
    """An MCP server's tools (stdio command or streamable-HTTP url) with user tasks and reward."""

    task_fields: ClassVar[tuple[str | tuple[str, ...], ...]] = (("prompt", "question", "messages"),)
    snapshot_exclude: ClassVar[tuple[str, ...]] = (
        *ToolEnv.snapshot_exclude, "_connection", "_reward_fn",
    )

    def __init__(
        self,
        *,
        command: Sequence[str] | None = None,
        url: str | None = None,
        task: str | Mapping[str, Any] | None = None,
        tasks: Sequence[Mapping[str, Any]] | str | None = None,
        reward: RewardFn | str | None = None,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        sandbox: bool = True,
        server_env: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        limits: ServerLimits | Mapping[str, Any] | None = None,
        startup_timeout_s: float = 60.0,
        tool_timeout_s: float = 30.0,
        max_turns: int = 8,
        **kwargs: Any,
    ) -> None:
        if command is not None and url is not None:
            raise ConfigError(
                f"{type(self).__name__} takes one of command=['python', 'server.py'] (a stdio MCP "
                "server) or url='http://host:port/mcp' (streamable HTTP), not both"
            )
        if command is None and url is None:  # playing and checks: the shipped example server
            command = ["python", str(notes_server_path())]
        if task is not None and (tasks is not None or kwargs.get("dataset") is not None):
            raise ConfigError("give either task=... (one task) or tasks=[...] (a task set), not both")
        if task is not None:
            kwargs["dataset"] = [{"prompt": task} if isinstance(task, str) else dict(task)]
        elif tasks is not None:
            kwargs["dataset"] = _load_tasks(tasks)
        super().__init__(max_turns=max_turns, tool_timeout_s=tool_timeout_s, **kwargs)
        if command is not None:
            resolve_command(command)  # a missing program or a bad command fails here, not later
        self.command = list(command) if command is not None else None
        self.url = url
        self.system_prompt = system_prompt
        self.sandbox = sandbox
        self.server_env = dict(server_env or {})
        self.headers = dict(headers or {})
        self.limits = limits if isinstance(limits, ServerLimits) else ServerLimits(**(limits or {}))
        self.startup_timeout_s = startup_timeout_s
        self._reward_fn = _resolve_reward(reward)
        self._connection: MCPConnection | None = None
        self.episode_failure: str | None = None

    # ----- server life cycle ---------------------------------------------------------------
    def _new_connection(self) -> MCPConnection:
        return MCPConnection(command=self.command, url=self.url, sandbox=self.sandbox,
                             limits=self.limits, env=self.server_env, headers=self.headers,
                             startup_timeout_s=self.startup_timeout_s)

    def _cache_key(self) -> tuple[Any, ...]:
        return (tuple(self.command or ()), self.url, self.sandbox)

    async def _aconnection(self) -> MCPConnection:
        """The episode's server, started on first use."""
        if self._connection is None:
            connection = self._new_connection()
            await connection.start()
            self._connection = connection
            _SCHEMA_CACHE.setdefault(self._cache_key(), [tool_schema(t) for t in connection.tools])
        return self._connection

    async def _aend_episode(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.close()

    def tool_schemas(self) -> list[dict[str, Any]]:
        key = self._cache_key()
        if key not in _SCHEMA_CACHE:  # discovery: one server, then kept for the first episode
            run_sync(self._aconnection())
        return [dict(s) for s in _SCHEMA_CACHE[key]]

    # ----- episode -------------------------------------------------------------------------
    def sample_task(self, rng: np.random.Generator) -> dict[str, Any]:
        if self._dataset is None:
            return {"id": "free-form", "prompt": DEFAULT_PROMPT}
        return super().sample_task(rng)

    def initial_messages(self, task: Mapping[str, Any]) -> list[Message]:
        if task.get("messages"):
            return [Message(role=m["role"], content=m["content"]) for m in task["messages"]]
        prompt = task.get("prompt", task.get("question"))
        if prompt is None:
            raise ConfigError(f"a task row needs 'prompt', 'question' or 'messages': {dict(task)}")
        return [Message(role="system", content=str(task.get("system") or self.system_prompt)),
                Message(role="user", content=str(prompt))]

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[tuple[Message, ...], dict[str, Any]]:
        return run_sync(self.areset(seed=seed, options=options))

    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[tuple[Message, ...], dict[str, Any]]:
        if self._connection is not None and (self.task is not None or self.closed):
            await self._aend_episode()  # a fresh server per episode (a discovery one is reused)
        if self._cache_key() not in _SCHEMA_CACHE:
            await self._aconnection()
        self.closed = False
        self.episode_failure = None
        observation, info = Env.reset(self, seed=seed, options=options)
        assert self.task is not None
        for i, call in enumerate(self.task.get("setup") or ()):
            outcome = await self._call(str(call["name"]), dict(call.get("arguments") or {}))
            if outcome.is_error:
                raise ToolError(f"setup call {i} ({call['name']}) of task "
                                f"{info['task_id']} failed: {outcome.text}")
        return observation, info

    async def _call(self, name: str, arguments: Mapping[str, Any]) -> CallOutcome:
        try:
            connection = await self._aconnection()
        except ToolError as exc:
            return CallOutcome(f"Error: {exc}", is_error=True, failure="crashed")
        return await connection.call(name, arguments, self.tool_timeout_s)

    async def arespond(self, action: Message) -> StepResult:
        if not action.tool_calls:
            reward = await self._areward(action)
            return StepResult(reward=reward, terminated=True, info=self.answer_info(action))
        messages: list[Message] = []
        errors = 0
        for call in action.tool_calls:
            outcome = await self._model_call(call)
            messages.append(self._tool_message(call, self._truncate(outcome.text)))
            errors += outcome.is_error
            if outcome.failure is not None:
                return self._failed(messages, outcome, len(messages), errors)
        self.consecutive_errors = self.consecutive_errors + 1 if errors else 0
        result = StepResult(observation=messages, tool_calls=len(messages), tool_errors=errors)
        if self.consecutive_errors >= self.max_consecutive_errors:
            result.terminated, result.stop_reason = True, StopReason.PARSE_ERROR
        return result

    async def _model_call(self, call: ToolCall) -> CallOutcome:
        if call.parse_error:
            return CallOutcome(f"Error: could not parse the tool call: {call.parse_error}", True)
        known = {s["function"]["name"] for s in self.tool_schemas()}
        if call.name not in known:
            names = ", ".join(sorted(known)) or "(none)"
            return CallOutcome(f"Error: unknown tool {call.name!r}; available tools: {names}", True)
        try:
            arguments = json.loads(call.arguments) if call.arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return CallOutcome(f"Error: the arguments of {call.name!r} are not valid JSON "
                               f"({exc.msg} at position {exc.pos}); write a JSON object", True)
        if not isinstance(arguments, dict):
            return CallOutcome(f"Error: the arguments of {call.name!r} must be a JSON object, "
                               f"got {type(arguments).__name__}", True)
        return await self._call(call.name, arguments)

    def _failed(self, messages: list[Message], outcome: CallOutcome, calls: int,
                errors: int) -> StepResult:
        self.episode_failure = outcome.text
        stop = StopReason.TIMEOUT if outcome.failure == "timeout" else StopReason.ERROR
        info = {"error": outcome.text, "mcp_failure": outcome.failure}
        return StepResult(observation=messages, terminated=True, info=info, stop_reason=stop,
                          tool_calls=calls, tool_errors=errors)

    async def _areward(self, action: Message) -> float:
        assert self.task is not None
        episode = MCPEpisode(self.task, tuple(self.history), action.content, self)
        value = self.reward(episode)
        if inspect.isawaitable(value):
            value = await value
        return float(value)

    def reward(self, episode: MCPEpisode) -> float | Awaitable[float]:
        """The reward of a finished episode (the ``reward=`` function; 0 without one)."""
        return self._reward_fn(episode) if self._reward_fn is not None else 0.0

    def score(self, action: Message) -> float:  # ToolEnv's sync hook; rewards go through arespond
        return float(run_sync(self._areward(action)))

    def fork(self) -> MCPEnv:
        """A copy at this point of the episode; the server's state cannot be forked, so the
        copy starts a fresh server at its first tool call (the original keeps its own)."""
        clone = copy.copy(self)
        clone.__dict__ = dict(self.__dict__)
        clone.restore(self.snapshot())
        clone._connection = None
        return clone

    def close(self) -> None:
        if self._connection is not None:
            run_sync(self._aend_episode())
        super().close()


def _load_tasks(tasks: Sequence[Mapping[str, Any]] | str) -> list[dict[str, Any]]:
    if isinstance(tasks, str):
        from palaestra.envs.shipped import iter_jsonl

        return list(iter_jsonl(tasks))
    return [dict(t) for t in tasks]


def _resolve_reward(reward: RewardFn | str | None) -> RewardFn | None:
    if reward is None or callable(reward):
        return reward
    module, _, name = str(reward).partition(":")
    if not module or not name:
        raise ConfigError(f"reward must be a function or 'package.module:function', got {reward!r}")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load the reward function {reward!r}: {exc}") from None
    if not callable(fn):
        raise ConfigError(f"the reward {reward!r} is not callable")
    return fn  # type: ignore[no-any-return]


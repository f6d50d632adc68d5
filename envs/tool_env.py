"""`ToolEnv`: a multi-turn env whose actions may call typed Python tools.

An action with tool calls gets one tool message per call (run concurrently, each under a
timeout). Every way a call can go wrong (unknown tool, malformed JSON, wrong argument types, a tool
that raises or hangs, output too long, non-UTF-8 bytes) becomes an error tool message the model
can read and the episode goes on; ``max_consecutive_errors`` error turns in a row end it with stop
reason ``parse_error``. An action without tool calls is the final answer, scored by `score`.

A `ToolRunner` may be injected (``tool_runner=`` or `use_tool_runner`): every call then goes
through ``runner.run(call, execute)``, which may answer it itself or run ``execute`` (the env's
own `call_tool`); ``runner.start_episode(task)`` is told of every reset. The record/replay cache
(`palaestra.rollout.tool_cache`) is one; the env's methods are never replaced.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

from palaestra.asyncio_utils import run_sync
from palaestra.envs.base import MultiTurnEnv, StepResult
from palaestra.envs.tools import Tool, ToolFunction, collect_tools
from palaestra.errors import ToolError
from palaestra.types import Message, StopReason, ToolCall

TRUNCATION_MARKER = "\n...[truncated {n} characters]"

#: one tool call -> (the tool message, whether it is an error)
ToolCallFn = Callable[[ToolCall], Awaitable[tuple[Message, bool]]]


async def _within(awaitable: Awaitable[Any], timeout_s: float) -> Any:
    """``await awaitable`` under a timeout, without the task `asyncio.wait_for` creates (3.11+)."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(timeout_s):
            return await awaitable
    return await asyncio.wait_for(awaitable, timeout_s)


class ToolRunner(Protocol):
    """Runs a `ToolEnv`'s tool calls (see the module docstring)."""

    def start_episode(self, task: Mapping[str, Any]) -> None:
        """A new episode of ``task`` begins (reset per-episode state)."""

    async def run(self, call: ToolCall, execute: ToolCallFn) -> tuple[Message, bool]:
        """Answer ``call``, with ``execute(call)`` when the env itself must run it."""


class ToolEnv(MultiTurnEnv):
    """Multi-turn env with tools; subclasses implement `initial_messages` and `score`."""

    step_in_thread: ClassVar[bool] = False  # tools decide themselves whether to use a thread
    snapshot_exclude: ClassVar[tuple[str, ...]] = ("_dataset", "_tools", "_schemas")

    def __init__(
        self,
        *,
        tools: Sequence[ToolFunction | Tool] | None = None,
        max_turns: int = 8,
        max_tool_output_chars: int = 4000,
        max_consecutive_errors: int = 3,
        tool_timeout_s: float = 30.0,
        tool_runner: ToolRunner | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(max_turns=max_turns, **kwargs)
        self.tool_runner: ToolRunner | None = None
        self.use_tool_runner(tool_runner)
        self._tools = collect_tools(self, list(tools or []))
        self._schemas: list[dict[str, Any]] | None = None  # built on first use, then reused
        self.max_tool_output_chars = max_tool_output_chars
        self.max_consecutive_errors = max_consecutive_errors
        self.tool_timeout_s = tool_timeout_s
        self.consecutive_errors = 0

    @property
    def tools(self) -> Mapping[str, Tool]:
        return self._tools

    def tool_schemas(self) -> list[dict[str, Any]]:
        if self._schemas is None:  # pydantic schema generation costs ~0.3 ms per reset otherwise
            self._schemas = [t.schema() for t in self._tools.values()]
        return [dict(s) for s in self._schemas]

    def use_tool_runner(self, runner: ToolRunner | None) -> None:
        """Route this env's tool calls through ``runner`` (None: run them directly)."""
        self.tool_runner = runner
        if runner is not None and "tool_runner" not in self.snapshot_exclude:
            # a shared resource (a cache with an open file), as a sandbox is: kept out of
            # snapshots, so a fork or restore keeps the live runner
            self.snapshot_exclude = (*self.snapshot_exclude, "tool_runner")  # type: ignore[misc]

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[tuple[Message, ...], dict[str, Any]]:
        observation, info = super().reset(seed=seed, options=options)
        if self.tool_runner is not None and self.task is not None:
            self.tool_runner.start_episode(self.task)
        return observation, info

    def on_reset(self, task: Mapping[str, Any]) -> None:
        self.consecutive_errors = 0

    def score(self, action: Message) -> float:
        """Reward of a final answer (an action without tool calls)."""
        raise NotImplementedError(f"{type(self).__name__} must implement score()")

    def answer_info(self, action: Message) -> dict[str, Any]:
        """Info of the final step: e.g. ``{"answer", "gold", "correct"}`` for evaluation."""
        return {}

    # sync `step` goes through the same async code path as the rollout
    def on_action(self, action: Message) -> StepResult:
        return run_sync(self.aon_action(action))

    async def aon_action(self, action: Message) -> StepResult:
        return self._with_rewards(action, await self.arespond(action))

    async def arespond(self, action: Message) -> StepResult:
        if not action.tool_calls:
            return StepResult(
                reward=self.score(action), terminated=True, info=self.answer_info(action)
            )
        runner = self.tool_runner
        calls = [self.call_tool(c) if runner is None else runner.run(c, self.call_tool)
                 for c in action.tool_calls]
        # one call (the common case) is awaited in place: gather would wrap it in a task
        outcomes = [await calls[0]] if len(calls) == 1 else await asyncio.gather(*calls)
        messages = [m for m, _ in outcomes]
        errors = sum(1 for _, is_error in outcomes if is_error)
        self.consecutive_errors = self.consecutive_errors + 1 if errors else 0
        result = StepResult(observation=messages, tool_calls=len(outcomes), tool_errors=errors)
        if self.consecutive_errors >= self.max_consecutive_errors:
            result.terminated, result.stop_reason = True, StopReason.PARSE_ERROR
        return result

    async def call_tool(self, call: ToolCall) -> tuple[Message, bool]:
        """Run one call; returns the tool message and whether it is an error."""
        try:
            text = await self._invoke(call)
            return self._tool_message(call, text), False
        except ToolError as exc:
            return self._tool_message(call, f"Error: {exc}"), True

    async def _invoke(self, call: ToolCall) -> str:
        if call.parse_error:
            raise ToolError(f"could not parse the tool call: {call.parse_error}")
        tool = self._tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self._tools)) or "(none)"
            raise ToolError(f"unknown tool {call.name!r}; available tools: {known}")
        try:
            result = await _within(tool.invoke(call.arguments), self.tool_timeout_s)
        except ToolError:
            raise
        except asyncio.TimeoutError:
            raise ToolError(
                f"{call.name!r} did not finish within {self.tool_timeout_s:g} s"
            ) from None
        except Exception as exc:  # a tool bug is an observation, not a crash
            raise ToolError(f"{call.name!r} raised {type(exc).__name__}: {exc}") from None
        return self._to_text(call.name, result)

    def _to_text(self, name: str, result: Any) -> str:
        if isinstance(result, bytes):
            try:
                text = result.decode("utf-8")
            except UnicodeDecodeError:
                shown = self._truncate(result.decode("utf-8", errors="replace"))
                raise ToolError(
                    f"{name!r} returned bytes that are not valid UTF-8; shown with "
                    f"replacement characters:\n{shown}"
                ) from None
        elif isinstance(result, str):
            text = result
        elif result is None:
            text = ""
        else:
            text = str(result)
        return self._truncate(text)

    def _truncate(self, text: str) -> str:
        limit = self.max_tool_output_chars
        if len(text) <= limit:
            return text
        return text[:limit] + TRUNCATION_MARKER.format(n=len(text) - limit)

    @staticmethod
    def _tool_message(call: ToolCall, content: str) -> Message:
        return Message(role="tool", content=content, tool_call_id=call.id or None, name=call.name)

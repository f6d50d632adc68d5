"""One live connection to an MCP server (a stdio process or a streamable-HTTP endpoint).

Built on the official ``mcp`` SDK (``pip install 'palaestra[mcp]'``): its transports
(`stdio_client`, `streamable_http_client`) and `ClientSession` (``initialize``, ``list_tools``,
``call_tool``). The SDK's sessions are anyio task groups that must be entered and left by one
task on one event loop, while palaestra envs are stepped from many loops (``asyncio.run`` per
sync step, the rollout worker's loop, threads). So every connection lives on one background
event loop thread shared by the process: an owner task opens the transport and the session,
serves calls, and closes them when asked; callers on any loop await the results.

Failures are values, not exceptions, past start-up: `call` returns a `CallOutcome` whose
``failure`` says whether the server crashed (its stderr tail is quoted) or did not answer in
time; the env turns both into an error tool message and ends the episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from palaestra.envs.ecosystem.background import on_background
from palaestra.envs.ecosystem.server_process import LaunchPlan, ServerLimits, plan_launch
from palaestra.errors import ConfigError, MissingExtraError, ToolError

STDERR_TAIL_CHARS = 2000


@dataclass(frozen=True)
class CallOutcome:
    """The result of one tool call as text for the model.

    ``is_error``: the model should read it as an error (``isError`` from the server, bad
    arguments, a crash, a timeout). ``failure``: None, ``"crashed"`` (the connection is gone)
    or ``"timeout"`` (no answer within the limit); both end the episode.
    """

    text: str
    is_error: bool = False
    failure: str | None = None


def _require_mcp() -> Any:
    try:
        import mcp
    except ImportError:
        raise MissingExtraError.for_module("mcp", "mcp") from None
    return mcp


def _field(obj: Any, *names: str, default: Any = None) -> Any:
    """An attribute under its mcp 2.x (snake_case) or 1.x (camelCase) name."""
    for name in names:
        if hasattr(obj, name):
            return getattr(obj, name)
    return default


def tool_schema(tool: Any) -> dict[str, Any]:
    """The OpenAI ``tools[i]`` entry of an MCP tool (its input schema as the parameters)."""
    params = dict(_field(tool, "input_schema", "inputSchema", default=None) or {})
    params.setdefault("type", "object")
    params.setdefault("properties", {})
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description or f"The {tool.name} tool.",
            "parameters": params,
        },
    }


def result_text(result: Any) -> str:
    """The text of a ``CallToolResult``: text blocks, else the structured content as JSON."""
    parts: list[str] = []
    for block in _field(result, "content", default=()) or ():
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind}: {_field(block, 'mime_type', 'mimeType', default='?')}]")
        elif kind == "resource":
            resource = block.resource
            text = getattr(resource, "text", None)
            parts.append(text if text is not None else f"[resource {resource.uri}]")
        elif kind == "resource_link":
            parts.append(f"[resource link {block.uri}]")
    structured = _field(result, "structured_content", "structuredContent")
    if not parts and structured is not None:
        parts.append(json.dumps(structured, ensure_ascii=False, sort_keys=True))
    return "\n".join(parts)


class MCPConnection:
    """A client session with one MCP server, from `start` to `close` (one episode).

    Give ``command`` (a stdio server, started in the sandbox unless ``sandbox=False``) or
    ``url`` (a streamable-HTTP endpoint, e.g. ``http://127.0.0.1:8000/mcp``).
    """

    def __init__(
        self,
        *,
        command: Sequence[str] | None = None,
        url: str | None = None,
        sandbox: bool = True,
        limits: ServerLimits | None = None,
        env: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        startup_timeout_s: float = 60.0,
    ) -> None:
        if (command is None) == (url is None):
            raise ConfigError(
                "an MCP connection needs exactly one of command=['python', 'server.py'] (a stdio "
                "server) or url='http://host:port/mcp' (a streamable-HTTP server)"
            )
        self.command = list(command) if command is not None else None
        self.url = url
        self.plan: LaunchPlan | None = None
        if command is not None:
            self.plan = plan_launch(command, sandbox=sandbox, limits=limits or ServerLimits(),
                                    env=env)
        self.headers = dict(headers or {})
        self.startup_timeout_s = startup_timeout_s
        self.tools: list[Any] = []
        self.server_name = ""
        self._session: Any = None
        self._stop: asyncio.Event | None = None
        self._owner: asyncio.Task[None] | None = None
        self._ended: asyncio.Event | None = None
        self._stderr: Any = None
        self._failure: str | None = None
        self.closed = False

    # ----- life cycle (each coroutine runs on the background loop) -------------------------
    async def start(self) -> MCPConnection:
        """Start the server (stdio), connect, initialize and list the tools."""
        await on_background(self._start())
        return self

    async def _start(self) -> None:
        _require_mcp()
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._stop, self._ended = asyncio.Event(), asyncio.Event()
        self._owner = asyncio.get_running_loop().create_task(self._own(ready))
        try:
            await asyncio.wait_for(asyncio.shield(ready), self.startup_timeout_s)
        except asyncio.TimeoutError:
            await self._close()
            raise ToolError(
                f"the MCP server {self._describe()} did not answer initialize/list_tools within "
                f"{self.startup_timeout_s:g} s{self._stderr_note()}"
            ) from None
        except BaseException:
            await self._close()
            raise
        finally:
            if ready.done() and not ready.cancelled():
                ready.exception()  # seen here; never "exception was never retrieved"

    async def _own(self, ready: asyncio.Future[None]) -> None:
        """Enter the transport and session, serve until asked to stop, then leave them."""
        from mcp import ClientSession

        assert self._stop is not None and self._ended is not None
        try:
            async with contextlib.AsyncExitStack() as stack:
                read, write = await self._enter_transport(stack)
                session = await stack.enter_async_context(ClientSession(read, write))
                init = await session.initialize()
                self.server_name = str(_field(_field(init, "server_info", "serverInfo"), "name",
                                              default="") or "")
                self.tools = list((await session.list_tools()).tools)
                self._session = session
                ready.set_result(None)
                await self._stop.wait()
        except BaseException as exc:
            self._failure = self._failure or f"{type(exc).__name__}: {_first_error(exc)}"
            if not ready.done():
                ready.set_exception(ToolError(
                    f"cannot start the MCP server {self._describe()}: {self._failure}"
                    f"{self._stderr_note()}"
                ))
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self._session = None
            self._ended.set()

    async def _enter_transport(self, stack: contextlib.AsyncExitStack) -> tuple[Any, Any]:
        if self.plan is not None:
            from mcp import StdioServerParameters, stdio_client

            self._stderr = stack.enter_context(tempfile.TemporaryFile("w+", encoding="utf-8"))  # noqa: SIM115 - closed by the stack
            params = StdioServerParameters(command=self.plan.executable, args=list(self.plan.args),
                                           cwd=self.plan.cwd)
            streams = await stack.enter_async_context(stdio_client(params, errlog=self._stderr))
        else:
            streams = await stack.enter_async_context(_http_client(self.url or "", self.headers))
        return streams[0], streams[1]

    async def close(self) -> None:
        """Stop the server process (or end the HTTP session); safe to call twice."""
        if self.closed:
            return
        await on_background(self._close())

    async def _close(self) -> None:
        self.closed = True
        if self._stop is not None:
            self._stop.set()
        if self._owner is not None and self._ended is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._ended.wait()), 15)
            except asyncio.TimeoutError:
                self._owner.cancel()
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(self._owner, 10)

    # ----- calls -------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._session is not None and not self.closed

    async def call(self, name: str, arguments: Mapping[str, Any], timeout_s: float) -> CallOutcome:
        """Call one tool; every way it can fail comes back as a `CallOutcome`."""
        return await on_background(self._call(name, dict(arguments), timeout_s))

    async def _call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> CallOutcome:
        session = self._session
        if session is None:
            return self._crashed()
        task = asyncio.ensure_future(session.call_tool(name, arguments))
        assert self._ended is not None
        ended = asyncio.ensure_future(self._ended.wait())
        try:
            done, _ = await asyncio.wait({task, ended}, timeout=timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
        if task not in done:
            task.cancel()
            if ended in done or self._session is None:
                return self._crashed()
            return CallOutcome(
                f"Error: the MCP tool {name!r} did not answer within {timeout_s:g} s",
                is_error=True, failure="timeout",
            )
        try:
            result = task.result()
        except Exception as exc:  # noqa: BLE001 - a protocol error is an observation
            if self._session is None or _connection_lost(exc):
                return self._crashed()
            return CallOutcome(f"Error: {_first_error(exc)}", is_error=True)
        text = result_text(result)
        if _field(result, "is_error", "isError", default=False):
            return CallOutcome(f"Error: {text}" if text else "Error: the tool failed", True)
        return CallOutcome(text)

    def _crashed(self) -> CallOutcome:
        why = f" ({self._failure})" if self._failure else ""
        return CallOutcome(
            f"Error: the MCP server {self._describe()} stopped responding or exited{why}"
            f"{self._stderr_note()}",
            is_error=True,
            failure="crashed",
        )

    # ----- helpers -----------------------------------------------------------------------
    def _describe(self) -> str:
        if self.command is not None:
            return " ".join(self.command)
        return str(self.url)

    def stderr_tail(self) -> str:
        """The end of what the stdio server wrote to stderr (empty for HTTP servers)."""
        if self._stderr is None or self._stderr.closed:
            return ""
        try:
            self._stderr.flush()
            self._stderr.seek(0)
            text: str = self._stderr.read()
        except (OSError, ValueError):
            return ""
        return text[-STDERR_TAIL_CHARS:]

    def _stderr_note(self) -> str:
        tail = self.stderr_tail().strip()
        return f"; its stderr ends with:\n{tail}" if tail else ""


def _http_client(url: str, headers: Mapping[str, str]) -> Any:
    from mcp.client import streamable_http

    client = getattr(streamable_http, "streamable_http_client", None)
    if client is None:  # mcp 1.x spelling (absent from the 2.x this type-checks against)
        legacy = getattr(streamable_http, "streamablehttp_client")
        return legacy(url, headers=dict(headers) or None)
    if headers:
        import httpx2

        return client(url, http_client=httpx2.AsyncClient(headers=dict(headers)))
    return client(url)


def _first_error(exc: BaseException) -> str:
    """The message of an exception, unwrapping exception groups to their first member."""
    while getattr(exc, "exceptions", None):  # an ExceptionGroup from a task group
        exc = exc.exceptions[0]  # type: ignore[attr-defined]
    return f"{exc}" or type(exc).__name__


def _connection_lost(exc: BaseException) -> bool:
    text = _first_error(exc).lower()
    return any(word in text for word in ("closed", "connection", "broken"))

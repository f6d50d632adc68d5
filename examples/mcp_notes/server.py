"""A small MCP stdio server: a notes (key -> text) store, written with the official ``mcp`` SDK.

Run by hand (it speaks JSON-RPC on stdin/stdout):

    python examples/mcp_notes/server.py

As a palaestra env: ``palaestra.envs.make("palaestra/MCPNotes-v0")`` (tasks and reward in
``palaestra.envs.ecosystem.notes``) or, free-form,
``palaestra.envs.make("palaestra/MCP-v0", command=["python", "examples/mcp_notes/server.py"])``.
The store lives in the server's memory: one server per episode, so each episode starts empty.
``--crash-on KEY`` and ``--hang-on KEY`` make ``get_note(KEY)`` kill the server or never answer
(the failure tests use them); ``--http PORT`` serves streamable HTTP on
``http://127.0.0.1:PORT/mcp`` instead.
"""

from __future__ import annotations

import argparse
import inspect
import os
import time

try:  # mcp >= 2
    from mcp.server.mcpserver import MCPServer as FastMCP
    from mcp.server.mcpserver.exceptions import ToolError
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP
    from mcp.server.fastmcp.exceptions import ToolError

MAX_NOTES = 100
MAX_TEXT = 2000


def build_server(crash_on: str | None = None, hang_on: str | None = None) -> FastMCP:
    notes: dict[str, str] = {}
    server = FastMCP("notes")

    @server.tool()
    def put_note(key: str, text: str) -> str:
        """Store ``text`` under ``key`` (replacing what was there)."""
        if not key.strip():
            raise ToolError("the key must not be empty")
        if len(text) > MAX_TEXT:
            raise ToolError(f"the text is longer than {MAX_TEXT} characters")
        if key not in notes and len(notes) >= MAX_NOTES:
            raise ToolError(f"the store is full ({MAX_NOTES} notes); delete one first")
        notes[key] = text
        return f"saved {key!r}"

    @server.tool()
    def get_note(key: str) -> str:
        """The text stored under ``key``."""
        if key == crash_on:
            os._exit(3)
        if key == hang_on:
            while True:
                time.sleep(1)
        if key not in notes:
            raise ToolError(f"no note named {key!r}; list_notes shows the keys")
        return notes[key]

    @server.tool()
    def list_notes() -> list[str]:
        """The keys of all stored notes, sorted."""
        return sorted(notes)

    @server.tool()
    def delete_note(key: str) -> str:
        """Delete the note ``key``."""
        if notes.pop(key, None) is None:
            raise ToolError(f"no note named {key!r}")
        return f"deleted {key!r}"

    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crash-on", default=None)
    parser.add_argument("--hang-on", default=None)
    parser.add_argument("--http", type=int, default=None, metavar="PORT",
                        help="serve streamable HTTP on 127.0.0.1:PORT/mcp instead of stdio")
    args = parser.parse_args()
    server = build_server(args.crash_on, args.hang_on)
    if args.http is None:
        server.run()  # stdio
    elif "host" in inspect.signature(server.run_streamable_http_async).parameters:  # mcp >= 2
        server.run("streamable-http", host="127.0.0.1", port=args.http)
    else:  # mcp 1.x: host and port are settings
        server.settings.host, server.settings.port = "127.0.0.1", args.http
        server.run("streamable-http")


if __name__ == "__main__":
    main()

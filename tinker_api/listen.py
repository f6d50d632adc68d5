"""`start_server`: a `TinkerServer` listening over HTTP inside a running event loop.

Apart from `palaestra.tinker_api.server` so that the server (which the routes type against) never
imports the app that holds the routes.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from palaestra.tinker_api.app import build_app
from palaestra.tinker_api.server import ServerConfig, TinkerServer


@dataclass
class RunningServer:
    """A server listening on ``url``; `stop` closes the port and the engine."""

    url: str
    server: TinkerServer
    runner: web.AppRunner

    async def stop(self) -> None:
        await self.runner.cleanup()
        await self.server.close()


async def start_server(config: ServerConfig, server: TinkerServer | None = None
                       ) -> RunningServer:
    """Build the server (unless given) and listen on ``config.host:config.port`` (port 0: a
    free one); returns once the port is open."""
    server = server or await TinkerServer.create(config)
    runner = web.AppRunner(build_app(server), access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    sockets = getattr(site._server, "sockets", None) or []  # aiohttp's bound sockets
    port = sockets[0].getsockname()[1] if sockets else config.port
    host = f"[{config.host}]" if ":" in config.host else config.host
    return RunningServer(f"http://{host}:{port}", server, runner)


__all__ = ["RunningServer", "start_server"]

"""The admin endpoint of a running run: ``palaestra engines add|remove|list``
(`palaestra.run.engines_cli`) reaches `ElasticEngines` through it, on loopback, with the token
in ``RUN/admin.token``."""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from palaestra.errors import ConfigError, PalaestraError
from palaestra.run.fleet.elastic import ADMIN_FILE, ENGINES_FILE, TOKEN_FILE, ElasticEngines

if TYPE_CHECKING:
    from palaestra.rollout.manager import RolloutManager
    from palaestra.run.fleet.engine_sync import EngineSync
    from palaestra.run.sections import RunSettings


# ------------------------------------------------------------------------- admin server
class AdminServer:
    """The loopback endpoint of `ElasticEngines` (``GET/POST /engines``,
    ``POST /engines/remove``), its address in ``admin.json``, its token in ``admin.token``."""

    def __init__(self, elastic: ElasticEngines, run_dir: Path, host: str = "127.0.0.1") -> None:
        self.elastic = elastic
        self.run_dir = Path(run_dir)
        self.host = host
        self.token = secrets.token_urlsafe(24)
        self.url = ""
        self._runner: Any = None

    async def start(self) -> AdminServer:
        from aiohttp import web

        @web.middleware
        async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
            return await self._auth(request, handler)  # type: ignore[no-any-return]

        app = web.Application(middlewares=[auth])
        app.router.add_get("/engines", self._list)
        app.router.add_post("/engines", self._add)
        app.router.add_post("/engines/remove", self._remove)
        # a request still waiting when the run ends (an engine starting) is cancelled soon
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                                     shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{self.host}:{port}"
        token_path = self.run_dir / TOKEN_FILE
        token_path.unlink(missing_ok=True)
        fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.token)
        partial = self.run_dir / (ADMIN_FILE + ".partial")
        partial.write_text(json.dumps({"url": self.url, "pid": os.getpid(),
                                       "started": time.time()}))
        partial.rename(self.run_dir / ADMIN_FILE)
        return self

    async def close(self) -> None:
        for name in (ADMIN_FILE, TOKEN_FILE):
            (self.run_dir / name).unlink(missing_ok=True)
        try:  # the engines as the run ends: URL, weight version, requests, actors
            final = await self.elastic.final_listing()
            (self.run_dir / ENGINES_FILE).write_text(json.dumps(final, indent=2))
        except (PalaestraError, OSError) as exc:  # a record only: the run's end goes on
            print(f"[engines] could not write {ENGINES_FILE}: {exc}", flush=True)
        finally:
            await self.elastic.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---------------------------------------------------------------------- handlers
    async def _auth(self, request: Any, handler: Any) -> Any:
        """The token, then the handler; a `PalaestraError` answers 400 (409: a conflict)."""
        from aiohttp import web

        given = request.headers.get("Authorization", "")
        if not secrets.compare_digest(given, f"Bearer {self.token}"):
            return web.json_response({"error": "wrong or missing token (the run's "
                                      f"{TOKEN_FILE})"}, status=401)
        try:
            return await handler(request)
        except PalaestraError as exc:
            status = 409 if "already" in str(exc) or "ended" in str(exc) else 400
            return web.json_response({"error": str(exc)}, status=status)

    async def _list(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response(self.elastic.listing())

    async def _body(self, request: Any) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as exc:
            raise ConfigError(f"the request body is not JSON: {exc}") from exc
        if not isinstance(body, dict) or not isinstance(body.get("url"), str):
            raise ConfigError('the request body needs {"url": "http://HOST:PORT"}')
        return body

    async def _add(self, request: Any) -> Any:
        from aiohttp import web

        try:
            body = await request.json()
        except ValueError as exc:
            raise ConfigError(f"the request body is not JSON: {exc}") from exc
        if isinstance(body, dict) and isinstance(body.get("gpus"), int) and "url" not in body:
            return web.json_response(await self.elastic.request_add_actor(body["gpus"]))
        if not isinstance(body, dict) or not isinstance(body.get("url"), str):
            raise ConfigError('the request body needs {"url": "http://HOST:PORT"} or '
                              '{"gpus": N}')
        return web.json_response(await self.elastic.request_add(body["url"]))

    async def _remove(self, request: Any) -> Any:
        from aiohttp import web

        body = await self._body(request)
        timeout = body.get("timeout_s")
        return web.json_response(await self.elastic.remove(
            body["url"], None if timeout is None else float(timeout)))


async def start_admin(cfg: RunSettings, run_dir: Path, engine: object, sync: EngineSync,
                      policy_path: Path, manager: RolloutManager | None = None
                      ) -> AdminServer | None:
    """The admin endpoint of a run whose engines are servers (``engine.kind = "sglang"`` or
    engine actors), else None (the embedded engine lives in the run's process). ``manager``:
    the run's rollout manager (Ray workers learn of engines joining and leaving through it)."""
    from palaestra.engines.clients.sglang import SGLangEngine

    if not isinstance(engine, SGLangEngine):  # servers (engine actors are SGLangEngines too)
        return None
    elastic = ElasticEngines(engine, sync, policy_path, cluster=cfg.rollout.cluster,
                             manager=manager, server=cfg.engine.kind,
                             launch_args=tuple(cfg.engine.launch_args))
    elastic.router()  # from the first step on: requests per engine are counted
    return await AdminServer(elastic, run_dir).start()


__all__ = ["AdminServer", "start_admin"]

"""Elastic engines: SGLang-protocol servers join and leave a running ``palaestra train`` run.

A run with ``engine.kind = "sglang"`` serves a small admin endpoint on loopback (aiohttp, port
picked free) while its RL steps run; its address is in ``<out>/admin.json`` and a random token
in ``<out>/admin.token`` (mode 0600): only someone who can read the run directory can drive it.
``palaestra engines add|remove|list`` (`palaestra.trainers.engines_cli`) talks to it. An HTTP
endpoint rather than a watched file because every command gets its answer: the version an
engine joined at, or why it was refused (wrong model, unreachable, already there).

- **add**: the URL is checked at once (answers, serves the policy's architecture, is not in the
  run yet); the join happens at the next step boundary, when no training touches the weights:
  the current policy goes to that server alone by the run's `EngineSync` path at the current
  version, then the router sends it requests and later pushes include it.
- **remove**: the router drains it at once (no new requests; those in flight finish, or after
  ``timeout_s`` are retried on another engine); the weight pushes drop it before the next one.
- **lost**: a server that stops answering has its requests retried on another engine by the
  `Router`; before every weight push each server's ``/health`` is asked, and one that does not
  answer is dropped from the run (``engines/lost``), so the push goes to the others.

Metrics (``engines/*`` in ``metrics.jsonl``): count, added, removed, lost, retried and the
requests each engine served.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from palaestra.errors import ConfigError, EngineError, PalaestraError

if TYPE_CHECKING:
    from palaestra.contracts import WeightSource
    from palaestra.rollout.engines.router import Router
    from palaestra.trainers.engine_sync import EngineSync

ADMIN_FILE = "admin.json"
TOKEN_FILE = "admin.token"
#: config.json fields two checkpoints must share for one's weights to load into the other
ARCH_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "intermediate_size", "vocab_size", "head_dim")


def normalize_url(url: str) -> str:
    """``url`` without a trailing slash; `ConfigError` unless it is ``http(s)://host:port``."""
    parts = urlsplit(url.strip())
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None \
            or parts.path.strip("/") or parts.query:
        raise ConfigError(f"{url!r} is not an engine URL: give the server's base URL "
                          "http://HOST:PORT (e.g. http://10.0.0.2:30000)")
    return url.strip().rstrip("/")


@dataclass(eq=False)
class _Join:
    client: Any
    done: asyncio.Future[dict[str, Any]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


class ElasticEngines:
    """The run's side: joins and removals of the servers of an `SGLangEngine`."""

    def __init__(self, engine: Any, sync: EngineSync, policy_path: Path, *,
                 cluster: str = "local", drain_timeout_s: float = 60.0) -> None:
        self.engine = engine
        self.sync = sync
        self.policy_path = Path(policy_path)
        self.cluster = cluster
        self.drain_timeout_s = drain_timeout_s
        self.version = 0  # the policy version the engines serve now
        self.step = 0
        self.lost = 0
        self._joins: list[_Join] = []
        self._clients_changed = False
        self._retired: list[Any] = []  # removed clients, closed once no push holds them
        self._client_kw = dict(getattr(engine, "client_kw", {}))

    # ------------------------------------------------------------------------ router
    def router(self) -> Router:
        """The engine's `Router` (an engine of one server gets one, so it can grow)."""
        from palaestra.rollout.engines.router import Router

        target = self.engine._engine()  # raises unless started
        if not isinstance(target, Router):
            target = Router(list(self.engine.clients),
                            health_interval_s=getattr(self.engine, "health_interval_s", 5.0))
            self.engine._target = target
        return target

    def urls(self) -> list[str]:
        return [c.url for c in self.engine.clients]

    # --------------------------------------------------------------------------- add
    async def request_add(self, url: str) -> dict[str, Any]:
        """Check ``url`` now; join it at the next step boundary; the join's result."""
        from palaestra.rollout.engines.sglang import SGLangClient

        self._refuse_on_ray("add")
        url = normalize_url(url)
        if url in self.urls() or any(j.client.url == url for j in self._joins):
            raise EngineError(f"{url} already serves this run (palaestra engines list)")
        client = SGLangClient(url, **self._client_kw)
        try:
            await self._check_model(client)
        except BaseException:
            await client.close()
            raise
        join = _Join(client)
        self._joins.append(join)
        return await asyncio.shield(join.done)

    async def _check_model(self, client: Any) -> None:
        if not await client.health():
            raise EngineError(f"no engine answers at {client.url} (GET /health); start it first "
                              "(palaestra serve MODEL, or python -m sglang.launch_server)")
        policy = _config_of(self.policy_path)
        info = await client.get_server_info()
        theirs = _config_of(Path(str(info.get("model_path", ""))))
        if theirs and policy:
            differ = [f"{k} {theirs.get(k)} != {policy.get(k)}" for k in ARCH_KEYS
                      if k in policy and theirs.get(k) != policy.get(k)]
            if differ:
                raise EngineError(f"{client.url} serves {info.get('model_path')}, another model "
                                  f"than the run's policy ({', '.join(differ)}); start it with "
                                  f"the run's model ({self.policy_path})")
        hidden = policy.get("hidden_size")
        if hidden is not None:  # a probe that needs no shared disk
            try:
                row = await client.get_weights_by_name("model.norm.weight", int(hidden) + 1)
            except EngineError as exc:
                raise EngineError(f"{client.url} has no weight model.norm.weight of the run's "
                                  f"policy ({exc}); start it with the run's model") from exc
            if len(row) != int(hidden):
                raise EngineError(f"{client.url} serves a model of hidden size {len(row)}, the "
                                  f"run's policy has {hidden}; start it with the run's model "
                                  f"({self.policy_path})")

    async def apply_joins(self, backend: WeightSource, version: int, step: int) -> list[str]:
        """At a step boundary (nothing trains): the waiting servers get the current weights
        at ``version`` and join the router; returns the URLs that joined."""
        self.version, self.step = version, step
        joins, self._joins = self._joins, []
        joined = []
        for join in joins:
            try:
                stats = await self.sync.push_to(join.client, backend, version)
                info = await join.client.get_model_info()
                if join.client.weight_version != version:
                    raise EngineError(f"{join.client.url} reports weight version "
                                      f"{info.get('weight_version')} after the push of {version}")
                self.router().add_engine(join.client)
                self.engine.clients.append(join.client)
                self._clients_changed = True
                joined.append(join.client.url)
                if not join.done.done():
                    join.done.set_result({"url": join.client.url, "version": version,
                                          "step": step, "push_s": round(stats.seconds, 3)})
                print(f"[engines] {join.client.url} joined at weight version {version} "
                      f"(before step {step})", flush=True)
            except Exception as exc:  # noqa: BLE001 - the requester gets the reason
                await join.client.close()
                if not join.done.done():
                    join.done.set_exception(exc if isinstance(exc, PalaestraError) else
                                            EngineError(f"{join.client.url} could not join: "
                                                        f"{exc}"))
        if self._clients_changed:
            await self.sync.set_clients(self.engine.clients)
            self._clients_changed = False
        return joined

    # ------------------------------------------------------------------------ remove
    async def remove(self, url: str, timeout_s: float | None = None) -> dict[str, Any]:
        """Drain ``url`` out of the run now; later weight pushes skip it."""
        self._refuse_on_ray("remove")
        url = normalize_url(url)
        client = next((c for c in self.engine.clients if c.url == url), None)
        if client is None:
            raise EngineError(f"{url} does not serve this run; it has: {', '.join(self.urls())}")
        if len(self.engine.clients) == 1:
            raise EngineError(f"{url} is the run's only engine: add another one first")
        self.engine.clients.remove(client)
        self._clients_changed = True
        result = await self.router().drain_engine(
            client, self.drain_timeout_s if timeout_s is None else timeout_s)
        self._retired.append(client)
        print(f"[engines] {url} removed: {result['finished']} requests finished on it, "
              f"{result['retried']} retried elsewhere", flush=True)
        return result

    async def settle(self) -> None:
        """Before a weight push: drop servers that stopped answering; pushes go to the rest."""
        router = self.router()
        clients = list(self.engine.clients)
        answers = await asyncio.gather(*(c.health() for c in clients))
        for client, ok in zip(clients, answers, strict=True):
            if ok or len(self.engine.clients) == 1:  # the last one: the push says why it fails
                continue
            router.remove_engine(client)
            self.engine.clients.remove(client)
            self._clients_changed = True
            self.lost += 1
            self._retired.append(client)
            print(f"[engines] {client.url} stopped answering: dropped from the run (its "
                  "requests were retried on the other engines)", flush=True)
        if self._clients_changed:
            await self.sync.set_clients(self.engine.clients)
            self._clients_changed = False
        retired, self._retired = self._retired, []
        for client in retired:
            await client.close()

    def weights_of(self, backend: WeightSource) -> _ElasticPush:
        """The run's `WeightPush`, after `settle`."""
        return _ElasticPush(self, backend)

    # ---------------------------------------------------------------------- reporting
    def metrics(self) -> dict[str, float]:
        return {**self.router().metrics(), "engines/lost": float(self.lost)}

    def listing(self) -> dict[str, Any]:
        return {"engines": self.router().status(), "version": self.version, "step": self.step,
                "joining": [j.client.url for j in self._joins], "metrics": self.metrics()}

    def _refuse_on_ray(self, what: str) -> None:
        if self.cluster == "ray":
            raise ConfigError(f"engines {what} needs rollout.cluster = 'local': the Ray rollout "
                              "workers route over their own copy of engine.urls")

    async def close(self) -> None:
        """Refuse the joins still waiting (the run is over)."""
        for client in self._retired:
            await client.close()
        joins, self._joins = self._joins, []
        for join in joins:
            await join.client.close()
            if not join.done.done():
                join.done.set_exception(EngineError(
                    f"the run ended before {join.client.url} could join"))


@dataclass(frozen=True)
class _ElasticPush:
    elastic: ElasticEngines
    backend: WeightSource

    async def push(self, version: int) -> None:
        await self.elastic.settle()
        await self.elastic.sync.push_now(self.backend, version)
        self.elastic.version = version


def _config_of(path: Path) -> dict[str, Any]:
    try:
        data = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    text = data.get("text_config")  # multimodal checkpoints nest the language model's
    return dict(text) if isinstance(text, dict) else dict(data)


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
        self._runner = web.AppRunner(app, access_log=None)
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

        body = await self._body(request)
        return web.json_response(await self.elastic.request_add(body["url"]))

    async def _remove(self, request: Any) -> Any:
        from aiohttp import web

        body = await self._body(request)
        timeout = body.get("timeout_s")
        return web.json_response(await self.elastic.remove(
            body["url"], None if timeout is None else float(timeout)))


async def start_admin(cfg: Any, run_dir: Path, engine: Any, sync: EngineSync,
                      policy_path: Path) -> AdminServer | None:
    """The admin endpoint of a run whose engines are servers (``engine.kind = "sglang"``),
    else None (the embedded engine lives in the run's process)."""
    if cfg.engine.kind != "sglang" or not hasattr(engine, "clients"):
        return None
    elastic = ElasticEngines(engine, sync, policy_path, cluster=cfg.rollout.cluster)
    elastic.router()  # from the first step on: requests per engine are counted
    return await AdminServer(elastic, run_dir).start()


__all__ = ["ADMIN_FILE", "TOKEN_FILE", "AdminServer", "ElasticEngines", "normalize_url",
           "start_admin"]

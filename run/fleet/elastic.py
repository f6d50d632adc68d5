"""Elastic engines: SGLang-protocol servers join and leave a running ``palaestra train`` run.

A run whose engines are servers (``engine.kind = "sglang"``, or engine actors of
``[placement]``) serves a small admin endpoint on loopback (aiohttp, port
picked free) while its RL steps run; its address is in ``<out>/admin.json`` and a random token
in ``<out>/admin.token`` (mode 0600): only someone who can read the run directory can drive it.
``palaestra engines add|remove|list`` (`palaestra.run.engines_cli`) talks to it. An HTTP
endpoint rather than a watched file because every command gets its answer: the version an
engine joined at, or why it was refused (wrong model, unreachable, already there).

- **add**: the URL is checked at once (answers, serves the policy's architecture, is not in the
  run yet); the join happens at the next step boundary, when no training touches the weights:
  the current policy goes to that server alone by the run's `EngineSync` path at the current
  version, then the router sends it requests and later pushes include it. ``add --gpus N``
  first starts an engine actor on N GPUs (0: a CPU engine) of the run's Ray cluster
  (`palaestra.run.fleet.actors`), then adds its URL the same way.
- **Ray workers** (``rollout.cluster = "ray"``) route over their own routers: every change of
  the run's engines is pushed to them (`RolloutManager.set_engine_urls`): a join at the step
  boundary where it got its weights, a removal at once (each worker drains it).
- **remove**: the router drains it at once (no new requests; those in flight finish, or after
  ``timeout_s`` are retried on another engine); the weight pushes drop it before the next one;
  an engine actor's server is stopped and its actor killed.
- **SGLang's router** (``engine.router = "sglang"``): joins and removals go through its worker
  API (``POST /workers``, ``DELETE /workers/{id}``); a drain waits for the server's own request
  count (``/get_load``) and sends what it aborts again through the router.
- **lost**: a server that stops answering has its requests retried on another engine by the
  `Router` (or by SGLang's router, once its health checks drop it); before every weight push each server's ``/health`` is asked, and one that does not
  answer is dropped from the run (``engines/lost``), so the push goes to the others (a dead
  engine actor is such a server; what is left of it is killed).

Metrics (``engines/*`` in ``metrics.jsonl``): count, added, removed, lost, retried and the
requests each engine served.
"""

from __future__ import annotations

import asyncio
import json
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from palaestra.errors import ConfigError, EngineError, PalaestraError
from palaestra.run.fleet.actors import actor_group_of

if TYPE_CHECKING:
    from palaestra.engines.clients.router import Router
    from palaestra.engines.clients.sglang import SGLangEngine
    from palaestra.engines.clients.sglang_router import SGLangRouted
    from palaestra.rollout.manager import RolloutManager
    from palaestra.run.fleet.actors import EngineGroup
    from palaestra.run.fleet.engine_sync import EngineSync
    from palaestra.run.fleet.weight_pushes import SyncPush

ADMIN_FILE = "admin.json"
TOKEN_FILE = "admin.token"
ENGINES_FILE = "engines.json"  # the run's engines at its end (URL, weight version, requests)
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


def _config_of(path: Path) -> dict[str, Any]:
    try:
        data = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    text = data.get("text_config")  # multimodal checkpoints nest the language model's
    return dict(text) if isinstance(text, dict) else dict(data)


@dataclass(eq=False)
class _Join:
    client: Any
    actor: bool = False  # an engine actor this run started for the join
    done: asyncio.Future[dict[str, Any]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


class ElasticEngines:
    """The run's side: joins and removals of the servers of an `SGLangEngine`."""

    def __init__(self, engine: SGLangEngine, sync: EngineSync, policy_path: Path, *,
                 cluster: str = "local", drain_timeout_s: float = 60.0,
                 manager: RolloutManager | None = None, server: str = "palaestra",
                 launch_args: tuple[str, ...] = ()) -> None:
        self.engine = engine
        self.manager = manager  # Ray workers: membership changes go to them through it
        #: the engine actors of the run (or of `add --gpus`); the launch of new ones
        self.actors: EngineGroup | None = actor_group_of(engine)
        self._own_actors = False
        self._launch = (server, launch_args)
        self._worker_metrics: dict[str, float] = {}
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
        self._client_kw = dict(engine.client_kw)

    # ------------------------------------------------------------------------ router
    def router(self) -> Router | SGLangRouted:
        """The engine's `Router` (an engine of one server gets one, so it can grow), or SGLang's
        router in front of its servers (``engine.router = "sglang"``: joins and removals go
        through its worker API)."""
        return self.engine.membership()  # raises unless started

    def urls(self) -> list[str]:
        return [c.url for c in self.engine.clients]

    # --------------------------------------------------------------------------- add
    async def request_add(self, url: str) -> dict[str, Any]:
        """Check ``url`` now; join it at the next step boundary; the join's result."""
        self._refuse_on_ray("add")
        url = normalize_url(url)
        if url in self.urls() or any(j.client.url == url for j in self._joins):
            raise EngineError(f"{url} already serves this run (palaestra engines list)")
        return await self._add(url, actor=False)

    async def _add(self, url: str, *, actor: bool) -> dict[str, Any]:
        from palaestra.engines.clients.sglang_client import SGLangClient

        client = SGLangClient(url, **self._client_kw)
        try:
            await self._check_model(client)
        except BaseException:
            await client.close()
            raise
        join = _Join(client, actor)
        self._joins.append(join)
        return await asyncio.shield(join.done)

    async def request_add_actor(self, gpus: int) -> dict[str, Any]:
        """Start an engine actor on ``gpus`` GPUs (0: CPU) of the run's Ray cluster, then join
        it as `request_add` does; the answer also names the actor."""
        self._refuse_on_ray("add")
        group = self._actor_group()
        member = await group.add(int(gpus))
        try:
            answer = await self._add(member.url, actor=True)
        except BaseException:
            await group.remove(member.url)
            raise
        return {**answer, "actor": member.describe()}

    def _actor_group(self) -> EngineGroup:
        if self.actors is None:  # a run of engine.urls servers: new ones as actors too
            from palaestra.run.fleet.actors import EngineGroup
            from palaestra.run.fleet.engine_actor import EngineLaunch

            server, args = self._launch
            self.actors = EngineGroup(EngineLaunch(
                str(self.policy_path), server="sglang" if server == "sglang" else "palaestra",
                extra_args=args))
            self._own_actors = True
        return self.actors

    def _is_actor(self, url: str) -> bool:
        return self.actors is not None and self.actors.member(url) is not None

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

    async def apply_joins(self, push: SyncPush, version: int, step: int) -> list[str]:
        """At a step boundary (nothing trains): the waiting servers get the current weights
        at ``version`` and join the router; returns the URLs that joined."""
        self.version, self.step = version, step
        from palaestra.run.fleet.weight_pushes import push_to_joining

        joins, self._joins = self._joins, []
        joined = []
        for join in joins:
            try:
                stats = await push_to_joining(push, join.client, version)
                info = await join.client.get_model_info()
                if join.client.weight_version != version:
                    raise EngineError(f"{join.client.url} reports weight version "
                                      f"{info.get('weight_version')} after the push of {version}")
                await _done(self.router().add_engine(join.client))
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
                if join.actor and self.actors is not None:
                    await self.actors.remove(join.client.url)
                if not join.done.done():
                    join.done.set_exception(exc if isinstance(exc, PalaestraError) else
                                            EngineError(f"{join.client.url} could not join: "
                                                        f"{exc}"))
        if self._clients_changed:
            await self.sync.set_clients(self.engine.clients)
            self._clients_changed = False
        if joined and self._on_ray():  # the Ray workers route to them from this step on
            await self.manager.set_engine_urls(self.urls(), self.drain_timeout_s)  # type: ignore[union-attr]
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
        timeout = self.drain_timeout_s if timeout_s is None else timeout_s
        drains = [self.router().drain_engine(client, timeout)]
        if self._on_ray():  # each Ray worker drains it out of its own router
            drains.append(self.manager.set_engine_urls(self.urls(), timeout))  # type: ignore[union-attr]
        result, *on_workers = await asyncio.gather(*drains)
        for part in on_workers:  # requests the workers' routers had on it
            result["finished"] += int(part["finished"])
            result["retried"] += int(part["retried"])
        result["in_flight"] = result["finished"] + result["retried"]
        self._retired.append(client)
        if self._is_actor(url):  # the engine actor this run started: its server stops
            await self.actors.remove(url)  # type: ignore[union-attr]
            result["actor_killed"] = True
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
            await _done(router.remove_engine(client))
            self.engine.clients.remove(client)
            self._clients_changed = True
            self.lost += 1
            self._retired.append(client)
            if self._is_actor(client.url):  # a dead engine actor: kill what is left of it
                await self.actors.forget(client.url)  # type: ignore[union-attr]
            print(f"[engines] {client.url} stopped answering: dropped from the run (its "
                  "requests were retried on the other engines)", flush=True)
        if self._clients_changed:
            await self.sync.set_clients(self.engine.clients)
            self._clients_changed = False
            if self._on_ray():  # out of the workers' routers (they retried its requests)
                await self.manager.set_engine_urls(self.urls(), 1.0)  # type: ignore[union-attr]
        if self._on_ray():  # what the workers' routers served, for this step's metrics
            self._worker_metrics = await self.manager.engine_metrics()  # type: ignore[union-attr]
        retired, self._retired = self._retired, []
        for client in retired:
            await client.close()

    # ---------------------------------------------------------------------- reporting
    def metrics(self) -> dict[str, float]:
        """The router's ``engines/*`` (with Ray workers: the requests their routers served
        added to the driver's own, e.g. evaluation) and ``engines/lost``."""
        out = {**self.router().metrics(), "engines/lost": float(self.lost)}
        for key, value in self._worker_metrics.items():
            out[key] = out.get(key, 0.0) + value
        return out

    def listing(self) -> dict[str, Any]:
        actors = [m.describe() for m in self.actors.members] if self.actors is not None else []
        return {"engines": self.router().status(), "version": self.version, "step": self.step,
                "joining": [j.client.url for j in self._joins], "metrics": self.metrics(),
                "actors": actors}

    async def final_listing(self) -> dict[str, Any]:
        """`listing` with the weight version each server reports now (the run's end)."""
        async def version(client: Any) -> str | None:
            try:
                info = await client.get_model_info()
            except EngineError:
                return None
            return str(info.get("weight_version"))

        out = self.listing()
        versions = await asyncio.gather(*(version(c) for c in self.engine.clients))
        out["served_versions"] = {c.url: v for c, v in zip(self.engine.clients, versions,
                                                           strict=True)}
        return out

    def _on_ray(self) -> bool:
        return self.cluster == "ray" and self.manager is not None

    def _refuse_on_ray(self, what: str) -> None:
        if self.cluster == "ray" and self.manager is None:
            raise ConfigError(f"engines {what} with rollout.cluster = 'ray' needs the run's "
                              "rollout manager (the Ray workers route over their own routers)")

    async def close(self) -> None:
        """Refuse the joins still waiting (the run is over); stop the engine actors that
        ``add --gpus`` started in a run whose own engines are not actors."""
        if self._own_actors and self.actors is not None:
            await self.actors.close()
        for client in self._retired:
            await client.close()
        joins, self._joins = self._joins, []
        for join in joins:
            await join.client.close()
            if not join.done.done():
                join.done.set_exception(EngineError(
                    f"the run ended before {join.client.url} could join"))


async def _done(result: object) -> None:
    """Await what the router's member calls return: SGLang's router answers over HTTP."""
    if inspect.isawaitable(result):
        await result


__all__ = ["ADMIN_FILE", "ENGINES_FILE", "TOKEN_FILE", "ElasticEngines", "normalize_url"]

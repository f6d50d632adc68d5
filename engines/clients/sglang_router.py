"""SGLang's own router (``sglang-router`` on PyPI, a Rust binary) in front of SGLang-protocol
servers, and `SGLangRouted`: one `Engine` over it.

`SGLangRouterProcess` launches ``python -m sglang_router.launch_router`` on a free loopback port
with the workers' URLs, waits until it routes to all of them, and drives its worker API
(``POST /workers``, ``GET /workers``, ``DELETE /workers/{id}``) as SGLang's RL users (slime)
do: a worker joins and leaves through the router's API, the router's own health checks take a
dead worker out of routing, and its cache-aware policy keeps a conversation's turns on the
worker that holds its prefix.

`SGLangRouted` is the `Engine` a run uses over it: generation goes through the router; weight
updates, pause/continue, abort and cache flushes go to every worker directly (the router does not
forward them; slime calls each engine the same way). A request the router answers with an error
(a worker died under it) is retried through the router, which routes it to a live worker; one a
drain had to abort is sent again the same way. Its member calls (`add_engine`, `remove_engine`,
`drain_engine`, `status`, `metrics`) are those of the Python `Router`, so elastic runs drive both
alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from palaestra.engine import EngineUnavailableError, Generation, SamplingParams
from palaestra.errors import ConfigError, EngineError

if TYPE_CHECKING:
    import torch

    from palaestra.engines.clients.server_process import ServerProcess
    from palaestra.engines.clients.sglang_client import SGLangClient

#: the pip requirement the router is tested with (pyproject's dev extra pins the same)
ROUTER_REQUIREMENT = "sglang-router==0.3.2"
#: what the router's log says when a worker lacks an endpoint name the router asks for first
FALLBACK_MARKERS = ("falling back to", "returned 404")


def router_installed() -> bool:
    """Whether ``sglang_router`` (the ``sglang-router`` wheel) is importable here."""
    return importlib.util.find_spec("sglang_router") is not None


def require_router() -> None:
    """`ConfigError` with the install command when ``sglang-router`` is missing."""
    if not router_installed():
        raise ConfigError(
            "engine.router = 'sglang' needs SGLang's router: pip install "
            f"'{ROUTER_REQUIREMENT}' (a Rust binary in a wheel; it runs on CPU and pulls in "
            "neither sglang nor torch), or set engine.router = 'palaestra'")


class SGLangRouterProcess:
    """One ``sglang_router.launch_router`` process on loopback, and its worker API."""

    def __init__(self, worker_urls: Sequence[str] = (), *, policy: str = "cache_aware",
                 log_path: str | Path | None = None, health_interval_s: int = 1,
                 health_failures: int = 2, extra_args: Sequence[str] = ()) -> None:
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        self.policy = policy
        self.log_path = Path(log_path) if log_path else None
        self.health_interval_s = health_interval_s
        self.health_failures = health_failures
        self.extra_args = list(extra_args)
        self.url = ""
        self.process: ServerProcess | None = None

    def argv(self, port: int, metrics_port: int) -> list[str]:
        """The router's command line: its own port and Prometheus port (free ones, so several
        routers share a host), health checks every ``health_interval_s`` seconds (a dead worker
        leaves routing after ``health_failures`` misses)."""
        return [sys.executable, "-m", "sglang_router.launch_router",
                "--worker-urls", *self.worker_urls,
                "--host", "127.0.0.1", "--port", str(port), "--policy", self.policy,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                "--health-check-interval-secs", str(self.health_interval_s),
                "--health-failure-threshold", str(self.health_failures),
                "--health-success-threshold", "1", "--log-level", "warn", *self.extra_args]

    async def start(self, process_type: type[ServerProcess], timeout_s: float = 60.0
                    ) -> SGLangRouterProcess:
        """Launch the router as a ``process_type`` (the SGLang client's `ServerProcess`, passed
        in so this module never imports the client's); returns once it routes to every worker."""
        from palaestra.engines.weights.weight_transfer import free_port

        require_router()
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.process = process_type(self.argv(port, free_port()), self.url,
                                     log_path=self.log_path)
        try:
            await self.process.wait_ready(timeout_s)
            await self.wait_workers(self.worker_urls, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    # --------------------------------------------------------------------------- worker API
    async def _call(self, method: str, path: str, payload: Any = None) -> Any:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=30)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session, session.request(
                    method, self.url + path, json=payload) as resp:
                body = await resp.read()
                if resp.status >= 400:
                    raise EngineError(f"the SGLang router at {self.url} answered {path} with "
                                      f"{resp.status}: {body.decode(errors='replace')[:300]}")
                import json

                return json.loads(body) if body else None
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            raise EngineUnavailableError(f"the SGLang router at {self.url} does not answer "
                                         f"{path}: {exc}; log: {self.log_path}") from exc

    async def workers(self) -> list[dict[str, Any]]:
        """The router's workers (``GET /workers``): url, id, is_healthy, load, ..."""
        out = await self._call("GET", "/workers")
        return list(out.get("workers", [])) if isinstance(out, dict) else []

    async def add_worker(self, url: str, timeout_s: float = 60.0) -> None:
        """Register ``url`` (``POST /workers``); returns once the router routes to it."""
        url = url.rstrip("/")
        await self._call("POST", "/workers", {"url": url, "worker_type": "regular"})
        await self.wait_workers([url], timeout_s)

    async def remove_worker(self, url: str, timeout_s: float = 30.0) -> None:
        """Deregister ``url`` (``DELETE /workers/{id}``); returns once the router dropped it
        (requests already forwarded to it finish there)."""
        url = url.rstrip("/")
        ids = [w["id"] for w in await self.workers() if w.get("url") == url]
        if not ids:
            raise EngineError(f"the SGLang router has no worker {url}")
        for worker_id in ids:
            await self._call("DELETE", f"/workers/{worker_id}")
        deadline = time.monotonic() + timeout_s
        while any(w.get("url") == url for w in await self.workers()):
            if time.monotonic() > deadline:
                raise EngineError(f"the SGLang router still lists {url} {timeout_s:.0f} s after "
                                  "its removal")
            await asyncio.sleep(0.05)

    async def wait_workers(self, urls: Sequence[str], timeout_s: float) -> None:
        """Until every URL of ``urls`` is a healthy worker of the router."""
        want = {u.rstrip("/") for u in urls}
        deadline = time.monotonic() + timeout_s
        while True:
            healthy = {w.get("url") for w in await self.workers() if w.get("is_healthy")}
            if want <= healthy:
                return
            if self.process is not None and self.process.proc.poll() is not None:
                raise EngineError(f"the SGLang router exited (code {self.process.proc.returncode})"
                                  f"; log tail:\n{self.process.log_tail()}")
            if time.monotonic() > deadline:
                raise EngineError(f"the SGLang router at {self.url} does not route to "
                                  f"{', '.join(sorted(want - healthy))} after {timeout_s:.0f} s; "
                                  f"log tail:\n{self.process.log_tail() if self.process else ''}")
            await asyncio.sleep(0.1)

    def fallbacks(self) -> list[str]:
        """Lines of the router's log where a worker lacked an endpoint name the router asked
        for first (empty: every name it used was answered)."""
        if self.log_path is None or not self.log_path.exists():
            return []
        return [line for line in self.log_path.read_text(errors="replace").splitlines()
                if any(marker in line for marker in FALLBACK_MARKERS)]

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(grace_s=5.0)
            self.process = None


class SGLangRouted:
    """An `Engine` over SGLang's router and the worker clients behind it (module docstring)."""

    def __init__(self, router: SGLangRouterProcess, clients: Sequence[SGLangClient],
                 front: SGLangClient, *, retries: int = 8, backoff_s: float = 0.25,
                 max_backoff_s: float = 2.0) -> None:
        self.router = router
        self.clients = list(clients)
        #: generation through the router (a client of ``router.url`` whose own retries are off:
        #: they are counted here)
        self.front = front
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.added = 0
        self.removed = 0
        self.retried = 0  # requests sent again: an error from the router, or a drain's abort
        self._ids = itertools.count()
        self._inflight: set[str] = set()
        self._drained: set[str] = set()  # request ids a drain aborted on the worker it left

    # ------------------------------------------------------------------------------ members
    @property
    def url(self) -> str:
        return self.router.url

    async def add_engine(self, client: SGLangClient, name: str | None = None) -> None:
        """Register the client's server with the router (it routes to it once this returns)."""
        await self.router.add_worker(client.url)
        if client not in self.clients:
            self.clients.append(client)
        self.added += 1

    async def remove_engine(self, client: SGLangClient | str) -> None:
        """Deregister a server (a dead one too: the router answers for it either way)."""
        url = client if isinstance(client, str) else client.url
        with contextlib.suppress(EngineError):  # the router's health checks dropped it already
            await self.router.remove_worker(url)
        self.clients = [c for c in self.clients if c.url != url]
        self.removed += 1

    async def drain_engine(self, client: SGLangClient | str, timeout_s: float = 60.0,
                           poll_s: float = 0.05) -> dict[str, Any]:
        """Take a server out of routing, let its requests finish for ``timeout_s``, then abort
        this engine's requests still on it: they are sent again through the router (to the
        servers left). ``{"name", "in_flight", "finished", "retried", "seconds"}``."""
        url = client if isinstance(client, str) else client.url
        member = next((c for c in self.clients if c.url == url), None)
        if member is None:
            raise EngineError(f"no engine {url} behind this router (it has: "
                              f"{', '.join(c.url for c in self.clients) or 'none'})")
        start = time.monotonic()
        in_flight = await _busy(member)
        await self.remove_engine(member)
        self.clients.append(member)  # still reachable for the abort below; dropped after
        try:
            while await _busy(member) and time.monotonic() - start < timeout_s:
                await asyncio.sleep(poll_s)
            left = await _busy(member)
            if left:
                ours = list(self._inflight)
                self._drained.update(ours)
                await member.abort(ours)
                while await _busy(member) and time.monotonic() - start < timeout_s + 10:
                    await asyncio.sleep(poll_s)
        finally:
            self.clients.remove(member)
        return {"name": url, "in_flight": in_flight, "finished": max(in_flight - left, 0),
                "retried": left, "seconds": time.monotonic() - start}

    @property
    def engines(self) -> list[SGLangClient]:
        return list(self.clients)

    def status(self) -> list[dict[str, Any]]:
        return [{"name": c.url, "weight_version": c.weight_version} for c in self.clients]

    def metrics(self) -> dict[str, float]:
        """``engines/count``, ``engines/added``, ``engines/removed``, ``engines/retried``."""
        return {"engines/count": float(len(self.clients)), "engines/added": float(self.added),
                "engines/removed": float(self.removed), "engines/retried": float(self.retried)}

    # ----------------------------------------------------------------------------- protocol
    @property
    def weight_version(self) -> int:
        versions = [c.weight_version for c in self.clients]
        return min(versions) if versions else self.front.weight_version

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *,
                       request_id: str | None = None, session_id: str | None = None
                       ) -> Generation:
        rid = request_id or f"sglr-{time.monotonic_ns():x}-{next(self._ids)}"
        errors: list[str] = []
        for attempt in range(1 + self.retries):
            if attempt:
                self.retried += 1
                await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
            sent = rid if attempt == 0 else f"{rid}_retry{attempt}"  # abort(rid) matches it
            self._inflight.add(sent)
            try:
                gen = await self.front.generate(input_ids, sampling, request_id=sent)
            except EngineUnavailableError as exc:  # the router had no live worker for it
                errors.append(str(exc))
                continue
            finally:
                self._inflight.discard(sent)
            if gen.finish_reason == "abort" and sent in self._drained:
                self._drained.discard(sent)  # a drain took its server away: send it again
                continue
            return gen
        raise EngineUnavailableError(f"the SGLang router at {self.url} could not serve the "
                                     f"request after {1 + self.retries} attempts: {errors[-1:]}")

    async def _each(self, what: str, *args: Any, **kw: Any) -> None:
        results = await asyncio.gather(*(getattr(c, what)(*args, **kw) for c in self.clients),
                                       return_exceptions=True)
        failed = [(c, r) for c, r in zip(self.clients, results) if isinstance(r, BaseException)]
        if failed:
            raise EngineError(f"{what} failed on {len(failed)} server(s): "
                              + "; ".join(f"{c.url}: {r}" for c, r in failed))

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor] | None = None, *, path: str | None = None,
                             version: int | None = None) -> None:
        new = self.weight_version + 1 if version is None else version
        await self._each("update_weights", state_dict, path=path, version=new)

    async def pause(self, mode: str = "in_place") -> None:
        await self._each("pause", mode)

    async def resume(self) -> None:
        await self._each("resume")

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        await self._each("abort", None if request_ids is None else list(request_ids))

    async def flush_cache(self) -> None:
        await self._each("flush_cache")

    async def health(self) -> bool:
        try:
            return any(w.get("is_healthy") for w in await self.router.workers())
        except EngineError:
            return False

    async def close(self) -> None:
        await self.front.close()
        await asyncio.get_running_loop().run_in_executor(None, self.router.stop)


async def _busy(client: SGLangClient) -> int:
    """Requests running or waiting on the server (its ``/get_load``); 0 when it is gone."""
    try:
        loads = await client.request("GET", "/get_load", retries=0, timeout_s=5.0)
    except EngineError:
        return 0
    return sum(int(entry.get("num_reqs", 0)) for entry in loads or [] if isinstance(entry, dict))


__all__ = ["FALLBACK_MARKERS", "ROUTER_REQUIREMENT", "SGLangRouted", "SGLangRouterProcess",
           "require_router", "router_installed"]

"""`SGLangEngine`: SGLang servers (or `palaestra serve`) through SGLang's native HTTP API.

It attaches to running servers (``urls``) and/or launches ``python -m sglang.launch_server``
processes (`palaestra.engines.clients.server_process.SGLangServerConfig`, one per GPU group),
waits for them to answer, and routes over several with `Router` (least outstanding requests,
sticky sessions for prefix-cache reuse, failover), or with ``router="sglang"`` through SGLang's
own router (`palaestra.engines.clients.sglang_router`), started in front of them. Each server is
an `palaestra.engines.clients.sglang_client.SGLangClient`.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from palaestra.engine import Generation, SamplingParams
from palaestra.engines.clients.server_process import (
    ServerProcess,
    SGLangServerConfig,
    wait_all_ready,
)
from palaestra.engines.clients.sglang_client import SGLangClient
from palaestra.errors import ConfigError, EngineError, MissingExtraError

if TYPE_CHECKING:
    import torch

    from palaestra.engines.clients.router import Router
    from palaestra.engines.clients.sglang_router import SGLangRouted

class SGLangEngine:
    """Attach to SGLang-compatible servers and/or launch them; an `Engine` over all of them.

    ``launcher`` maps a `SGLangServerConfig` to an argv (default: `SGLangServerConfig.command`,
    which needs sglang installed); call ``await start()`` (or use ``async with``) before use.
    """

    def __init__(self, urls: str | Sequence[str] = (), *, servers: Sequence[SGLangServerConfig] = (),
                 launcher: Callable[[SGLangServerConfig], list[str]] | None = None,
                 startup_timeout_s: float = 900.0, log_dir: str | Path | None = None,
                 health_interval_s: float = 5.0, router: str = "palaestra",
                 router_args: Sequence[str] = (), **client_kw: Any) -> None:
        if router not in ("palaestra", "sglang"):
            raise ConfigError(f"router = {router!r}: choose 'palaestra' (the Python Router) or "
                              "'sglang' (SGLang's router, pip install sglang-router)")
        if isinstance(urls, str):
            urls = [urls]
        if not urls and not servers:
            raise ConfigError("SGLangEngine needs urls to attach to or servers to launch")
        self.urls = [u.rstrip("/") for u in urls]
        self.servers = list(servers)
        self.launcher = launcher
        self.startup_timeout_s = startup_timeout_s
        self.log_dir = Path(log_dir) if log_dir else None
        self.health_interval_s = health_interval_s
        self.router = router
        self.router_args = tuple(router_args)  # extra flags of SGLang's router
        self.client_kw = client_kw
        self.processes: list[ServerProcess] = []
        self.clients: list[SGLangClient] = []
        #: the LoRA adapter requests that name none run (set by a LoRA run's weight sync)
        self.default_lora: str | None = None
        self._target: Any = None

    async def __aenter__(self) -> SGLangEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        if self._target is not None:
            return
        if self.servers and self.launcher is None and importlib.util.find_spec("sglang") is None:
            raise MissingExtraError.for_module("sglang", "sglang")
        if self.router == "sglang":
            from palaestra.engines.clients.sglang_router import require_router

            require_router()  # before any server starts
        for i, cfg in enumerate(self.servers):
            argv = self.launcher(cfg) if self.launcher is not None else cfg.command()
            log = self.log_dir / f"sglang-{i}-{cfg.port}.log" if self.log_dir else None
            if self.log_dir:
                self.log_dir.mkdir(parents=True, exist_ok=True)
            self.processes.append(ServerProcess(argv, cfg.url, cfg.env(), log))
        await wait_all_ready(self.processes, self.startup_timeout_s)
        urls = self.urls + [p.url for p in self.processes]
        self.clients = [SGLangClient(u, **self.client_kw) for u in urls]
        if self.router == "sglang":
            self._target = await self._sglang_router(urls)
        elif len(self.clients) == 1:
            self._target = self.clients[0]
        else:
            from palaestra.engines.clients.router import Router

            self._target = Router(self.clients, health_interval_s=self.health_interval_s)

    async def _sglang_router(self, urls: Sequence[str]) -> Any:
        """SGLang's router in front of ``urls`` (the launched servers stop if it cannot start)."""
        from palaestra.engines.clients.sglang_router import SGLangRouted, SGLangRouterProcess

        log = self.log_dir / "sglang-router.log" if self.log_dir else None
        try:
            process = await SGLangRouterProcess(urls, log_path=log,
                                                extra_args=self.router_args
                                                ).start(ServerProcess)
        except BaseException:
            for p in self.processes:
                p.stop()
            self.processes = []
            raise
        front = SGLangClient(process.url, retries=0, request_timeout_s=3600.0)
        return SGLangRouted(process, self.clients, front)

    def membership(self) -> Router | SGLangRouted:
        """The router whose members can change while the engine runs (engines joining and
        leaving a run): SGLang's router, or the Python `Router`, which an engine of one server
        gets here so that it can grow. Raises `EngineError` unless started."""
        from palaestra.engines.clients.router import Router
        from palaestra.engines.clients.sglang_router import SGLangRouted

        target = self._engine()
        if not isinstance(target, (Router, SGLangRouted)):
            target = Router(list(self.clients), health_interval_s=self.health_interval_s)
            self._target = target
        return target

    def _engine(self) -> Any:
        if self._target is None:
            raise EngineError("SGLangEngine is not started; call `await engine.start()` first")
        return self._target

    @property
    def weight_version(self) -> int:
        return int(self._engine().weight_version)

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *,
                       request_id: str | None = None, session_id: str | None = None,
                       lora: str | None = None) -> Generation:
        await self.start()
        lora = lora if lora is not None else self.default_lora
        kwargs: dict[str, Any] = {} if lora is None else {"lora": lora}
        if kwargs and not isinstance(self._engine(), SGLangClient):
            raise EngineError("LoRA requests go to one server for now: the router over several "
                              "servers does not forward lora_path yet (use one engine.urls entry)")
        return await self._engine().generate(input_ids, sampling, request_id=request_id,  # type: ignore[no-any-return]
                                             session_id=session_id, **kwargs)

    async def load_lora_adapter(self, name: str, path: str, *, pinned: bool = False) -> None:
        """Load the adapter on every server (each must see ``path``)."""
        await self.start()
        await asyncio.gather(*(c.load_lora_adapter(name, path, pinned=pinned)
                               for c in self.clients))

    async def unload_lora_adapter(self, name: str) -> None:
        await self.start()
        await asyncio.gather(*(c.unload_lora_adapter(name) for c in self.clients))

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor] | None = None, *, path: str | None = None,
                             version: int | None = None) -> None:
        await self._engine().update_weights(state_dict, path=path, version=version)

    async def pause(self, mode: str = "in_place") -> None:
        await self._engine().pause(mode)

    async def resume(self) -> None:
        await self._engine().resume()

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        await self._engine().abort(request_ids)

    async def flush_cache(self) -> None:
        await self._engine().flush_cache()

    async def health(self) -> bool:
        return self._target is not None and bool(await self._target.health())

    async def close(self) -> None:
        if self._target is not None:
            await self._target.close()
        for c in self.clients:
            await c.close()
        for p in self.processes:
            await asyncio.get_running_loop().run_in_executor(None, p.stop)
        self._target = None
        self.processes = []


__all__ = ["SGLangEngine"]

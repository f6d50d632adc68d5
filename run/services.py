"""``[services]``: processes a training run starts beside itself and stops at its end.

``retriever = "serve"`` serves the env's BM25 index (``env.kwargs``: ``retriever = "bm25"`` or
unset, ``corpus``) with ``palaestra serve-retriever`` on a free loopback port for the whole run,
and every env the run builds (rollout workers, held-out evaluations) queries it over HTTP
(``/retrieve``) the way Search-R1 queries its retrieval server. The recorded settings keep
``retriever = "bm25"`` and the corpus (``config.json``, ``final-model/trained_with.json``): a
resumed run starts a new server, and ``palaestra eval --model RUN/final-model`` builds the same
index in process (or takes ``--env-kwargs '{"retriever": URL}'``).

    async with run_services(cfg, run_dir):      # in `train_async`, around the whole run
        ... envs.make(cfg.env.id, **run_env_kwargs(cfg)) ...

The server stops when the block ends, and also when the run is killed (see
`palaestra.run.retriever`). Torch-free: `ServicesSection` is part of `RunSettings`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any

from palaestra.config import Problem

if TYPE_CHECKING:
    from palaestra.run.sections import RunSettings


#: env kwargs that the running services override (the served retriever's URL)
_OVERRIDES: ContextVar[Mapping[str, Any]] = ContextVar("palaestra_service_env_kwargs", default={})


def run_env_kwargs(cfg: RunSettings) -> dict[str, Any]:
    """The env kwargs of the envs this run builds: the config's, with the URLs of the services
    running now (inside `run_services`) in place of what they serve."""
    return {**cfg.env.kwargs, **_OVERRIDES.get()}


def services_problems(cfg: RunSettings) -> list[Problem]:
    """What keeps ``[services]`` from starting (empty when nothing is asked)."""
    if cfg.services.retriever == "none":
        return []
    problems = []
    spec = cfg.env.kwargs.get("retriever", "bm25")
    if spec != "bm25":
        problems.append(Problem(("services.retriever", "env.kwargs.retriever"), (
            f"services.retriever = \"serve\" serves the env's BM25 index, but env.kwargs.retriever"
            f" = {spec!r}; set env.kwargs.retriever = \"bm25\" (with env.kwargs.corpus), or "
            "services.retriever = \"none\" to use that retriever as it is")))
    corpus = cfg.env.kwargs.get("corpus")
    if corpus is not None and not Path(str(corpus)).is_file():
        problems.append(Problem(("env.kwargs.corpus",), (
            f"env.kwargs.corpus = {corpus!r} does not exist (relative paths start at the "
            "directory palaestra train runs in)")))
    return problems


@asynccontextmanager
async def run_services(cfg: RunSettings, root: Path) -> AsyncIterator[None]:
    """Start the services ``cfg.services`` asks for (logs in ``root/services``), make
    `run_env_kwargs` point at them inside the block, and stop them when it ends."""
    if cfg.services.retriever == "none":
        yield
        return
    from palaestra.run.retriever import RetrieverServer

    corpus = cfg.env.kwargs.get("corpus")
    topk = int(cfg.env.kwargs.get("topk", 3))
    server = RetrieverServer(corpus=corpus, topk=topk, log_path=root / "services" / "retriever.log")
    token = None
    try:
        await server.wait_ready(cfg.services.retriever_startup_timeout_s)
        print(f"[services] palaestra serve-retriever (pid {server.pid}) serves "
              f"{corpus or 'the shipped corpus'} on {server.url}", flush=True)
        token = _OVERRIDES.set({**_OVERRIDES.get(), "retriever": server.url})
        yield
    finally:
        if token is not None:
            _OVERRIDES.reset(token)
        server.stop()


__all__ = ["run_env_kwargs", "run_services", "services_problems"]

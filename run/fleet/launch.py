"""The inference servers a training run starts itself (``[engine] launch``).

One server per group of ``launch_tp`` GPUs of ``launch_gpus`` (each pinned with
``CUDA_VISIBLE_DEVICES``), or one CPU server when no GPU is listed, on free ports. "sglang"
launches ``python -m sglang.launch_server``; "palaestra" launches ``palaestra serve``, which speaks
the same HTTP API (weight-update groups included), so a one-node disaggregated run needs no SGLang.
`SGLangEngine` owns the processes: it waits for their health and stops them at close, and with
``engine.router = "sglang"`` starts SGLang's router in front of them (stopped at close too).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from palaestra.engines.clients.server_process import SGLangServerConfig
    from palaestra.run.sections import EngineSection


def server_configs(engine: EngineSection, model_path: Path) -> list[SGLangServerConfig]:
    """The launch configs of ``engine`` for the checkpoint at ``model_path``."""
    from palaestra.engines.clients.server_process import SGLangServerConfig
    from palaestra.engines.weights.weight_transfer import free_port

    gpus = list(engine.launch_gpus)
    tp = engine.launch_tp
    groups: list[tuple[int, ...] | None] = (
        [tuple(gpus[i:i + tp]) for i in range(0, len(gpus), tp)] if gpus else [None])
    return [SGLangServerConfig(str(model_path), port=free_port(), tp_size=tp, gpu_ids=ids,
                               extra_args=tuple(engine.launch_args)) for ids in groups]


def palaestra_serve_argv(cfg: SGLangServerConfig) -> list[str]:
    """``palaestra serve`` for one launch config (CUDA when the config has GPUs, else CPU)."""
    from palaestra.engines.serve.serve import serve_argv

    return serve_argv(cfg.model_path, port=cfg.port, host=cfg.host,
                      device="cuda" if cfg.gpu_ids else "cpu", extra=cfg.extra_args)


def launched_engine(engine: EngineSection, model_path: Path, log_dir: Path) -> Any:
    """An `SGLangEngine` over ``engine.urls`` plus the servers ``engine.launch`` starts."""
    from palaestra.engines.clients.sglang import SGLangEngine

    servers = server_configs(engine, model_path) if engine.launch != "none" else []
    launcher = palaestra_serve_argv if engine.launch == "palaestra" else None
    return SGLangEngine(engine.urls, servers=servers, launcher=launcher, log_dir=log_dir,
                        router=engine.router, router_args=tuple(engine.router_args))


__all__ = ["launched_engine", "palaestra_serve_argv", "server_configs"]

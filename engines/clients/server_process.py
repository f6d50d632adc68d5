"""Server processes a run launches: `SGLangServerConfig` (one ``sglang.launch_server`` per GPU
group, `gpu_groups`), `ServerProcess` (a launched process in its own process group, with its
log file) and `wait_all_ready`."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from palaestra.engines.clients.sglang_client import SGLangClient
from palaestra.errors import ConfigError, EngineError

if TYPE_CHECKING:
    pass

@dataclass(frozen=True)
class SGLangServerConfig:
    """One ``sglang.launch_server`` process (a GPU group of ``tp_size`` GPUs)."""

    model_path: str
    port: int = 30000
    host: str = "127.0.0.1"
    tp_size: int = 1
    mem_fraction_static: float | None = None
    gpu_ids: tuple[int, ...] | None = None
    extra_args: tuple[str, ...] = ()
    python: str = field(default_factory=lambda: sys.executable)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The argv of ``python -m sglang.launch_server`` for this server."""
        cmd = [self.python, "-m", "sglang.launch_server", "--model-path", self.model_path,
               "--tp-size", str(self.tp_size), "--host", self.host, "--port", str(self.port)]
        if self.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(self.mem_fraction_static)]
        return cmd + list(self.extra_args)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.gpu_ids is not None:
            if len(self.gpu_ids) != self.tp_size:
                raise ConfigError(f"gpu_ids {self.gpu_ids} must list tp_size={self.tp_size} GPUs")
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpu_ids))
        return env


def gpu_groups(model_path: str, num_gpus: int, tp_size: int, *, base_port: int = 30000,
               **kw: Any) -> list[SGLangServerConfig]:
    """One config per group of ``tp_size`` GPUs among ``num_gpus`` (consecutive ports)."""
    if num_gpus % tp_size:
        raise ConfigError(f"{num_gpus} GPUs do not split into groups of tp_size={tp_size}")
    return [
        SGLangServerConfig(model_path, port=base_port + g, tp_size=tp_size,
                           gpu_ids=tuple(range(g * tp_size, (g + 1) * tp_size)), **kw)
        for g in range(num_gpus // tp_size)
    ]


class ServerProcess:
    """A launched server process (own process group) with its log file."""

    def __init__(self, argv: Sequence[str], url: str, env: Mapping[str, str] | None = None,
                 log_path: str | Path | None = None) -> None:
        self.argv = list(argv)
        self.url = url
        self.log_path = Path(log_path) if log_path else None
        self._log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.argv, env=dict(env) if env else None,
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def log_tail(self, n: int = 3000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    async def wait_ready(self, timeout_s: float) -> None:
        client = SGLangClient(self.url, retries=0, connect_timeout_s=2)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise EngineError(
                        f"{' '.join(self.argv[:4])} ... exited with code {self.proc.returncode} "
                        f"before answering on {self.url}; log tail:\n{self.log_tail()}")
                if await client.health(timeout_s=2):
                    return
                await asyncio.sleep(0.25)
        finally:
            await client.close()
        self.stop()
        raise EngineError(f"{self.url} did not become healthy within {timeout_s:.0f} s; "
                          f"log tail:\n{self.log_tail()}")

    def stop(self, grace_s: float = 10.0) -> None:
        from palaestra.processes import terminate_process_group

        terminate_process_group(self.proc, grace_s)
        if self._log is not subprocess.DEVNULL:
            self._log.close()  # type: ignore[union-attr]


async def wait_all_ready(processes: Sequence[ServerProcess], timeout_s: float) -> None:
    """Wait until every server answers; if one fails (or the wait is cancelled), stop them all."""
    try:
        await asyncio.gather(*(p.wait_ready(timeout_s) for p in processes))
    except BaseException:
        for p in processes:
            p.stop()
        raise


__all__ = ["SGLangServerConfig", "ServerProcess", "gpu_groups", "wait_all_ready"]

"""One engine as a Ray actor: its launch settings (`EngineLaunch`, `server_argv`), the actor
that runs its server process on its bundle's GPUs (`EngineActor`) and the member record a group
keeps of it (`EngineMember`)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from palaestra.errors import EngineError, MissingExtraError

if TYPE_CHECKING:
    pass


#: Ray lets an actor see every GPU of its node when this is set (its bundles' ids are then real)
NOSET_CUDA = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class EngineLaunch:
    """How every engine of a group starts its server (picklable: it travels to the actors)."""

    model_path: str
    server: Literal["palaestra", "sglang"] = "palaestra"
    colocate: bool = False  # the engine shares its GPUs with trainer ranks
    extra_args: tuple[str, ...] = ()
    mem_fraction_static: float = 0.45  # SGLang, colocated: what the trainer leaves it
    startup_timeout_s: float = 600.0
    log_dir: str | None = None
    driver_ip: str | None = None  # servers on the driver's node bind to loopback
    cpus_per_engine: float = 1.0  # an added CPU engine's actor (plan engines: their bundles')


def server_argv(launch: EngineLaunch, *, host: str, port: int, gpus: int) -> list[str]:
    """The command line of one engine's server on ``gpus`` GPUs (0: CPU, ``palaestra serve``)."""
    if launch.server == "sglang":  # SGLang's documented CLI (python -m sglang.launch_server)
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", launch.model_path,
               "--tp-size", str(max(gpus, 1)), "--host", host, "--port", str(port)]
        if launch.colocate:  # it frees its memory while the trainer trains
            cmd.append("--enable-memory-saver")
            if "--mem-fraction-static" not in launch.extra_args:
                cmd += ["--mem-fraction-static", str(launch.mem_fraction_static)]
        return cmd + list(launch.extra_args)
    from palaestra.engines.serve.serve import serve_argv

    return serve_argv(launch.model_path, port=port, host=host,
                      device="cuda" if gpus else "cpu", extra=launch.extra_args)


def _die_with_parent() -> None:
    """In the server's process before exec: SIGKILL it when the actor's thread that started it
    ends (the actor killed or crashed), so a server never outlives its actor: a dead actor is a
    lost server (SGLang's own subprocesses die with their launcher the same way)."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class EngineActor:
    """The Ray actor of one engine: starts its server as a child process and watches it."""

    def __init__(self, launch: EngineLaunch, index: int, gpu_ids: list[int] | None = None,
                 gpus: int = 0) -> None:
        self.launch = launch
        self.index = index
        self.gpu_ids = gpu_ids
        self.gpus = gpus
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    def start(self) -> dict[str, Any]:
        """Start the server; its URL (and pids, node) once ``/health`` answers."""
        import ray

        from palaestra.engines.weights.weight_transfer import free_port

        launch = self.launch
        if launch.server == "sglang" and importlib.util.find_spec("sglang") is None:
            raise MissingExtraError.for_module("sglang", "sglang")
        node_ip = ray.util.get_node_ip_address()
        host = "127.0.0.1" if node_ip == launch.driver_ip else node_ip
        port = free_port()
        self.url = f"http://{host}:{port}"
        argv = server_argv(launch, host=host, port=port, gpus=self.gpus)
        env = dict(os.environ)
        env.pop(NOSET_CUDA, None)
        if self.gpu_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpu_ids)
        log: Any = subprocess.DEVNULL
        if launch.log_dir:
            Path(launch.log_dir).mkdir(parents=True, exist_ok=True)
            self.log_path = Path(launch.log_dir) / f"engine-{self.index}-{port}.log"
            log = open(self.log_path, "ab")  # noqa: SIM115 - the child writes it as long as it runs
        # preexec_fn only calls prctl (async-signal-safe enough); the actor starts one child
        self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     preexec_fn=_die_with_parent)  # noqa: PLW1509
        deadline = time.monotonic() + launch.startup_timeout_s
        while not self._answers():
            if self.proc.poll() is not None:
                raise EngineError(f"engine {self.index}: {' '.join(argv[:5])} ... exited with "
                                  f"code {self.proc.returncode} before answering on {self.url}; "
                                  f"log tail:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise EngineError(f"engine {self.index} did not answer on {self.url} within "
                                  f"{launch.startup_timeout_s:.0f} s; log tail:\n{self.log_tail()}")
            time.sleep(0.2)
        return {"url": self.url, "pid": os.getpid(), "server_pid": self.proc.pid,
                "node_ip": node_ip, "gpu_ids": self.gpu_ids}

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return bool(200 <= r.status < 300)
        except OSError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 3000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log: set the launch's log_dir)"
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the server's process group (the server drains), SIGKILL after ``grace_s``."""
        if self.proc is not None:
            from palaestra.processes import terminate_process_group

            terminate_process_group(self.proc, grace_s)


def gpu_ids_here() -> list[int]:
    """(A probe task on one bundle) the physical GPU ids Ray gave it."""
    import ray

    return [int(g) for g in ray.get_gpu_ids()]


@dataclass
class EngineMember:
    """One started engine: its actor, URL, processes and (for an added one) its own group."""

    index: int
    url: str
    actor: Any
    pid: int
    server_pid: int
    node_ip: str
    gpus: int
    placement_group: Any = None  # the engine's own placement group (removed with it)

    def describe(self) -> dict[str, Any]:
        return {"index": self.index, "url": self.url, "actor_pid": self.pid,
                "server_pid": self.server_pid, "node": self.node_ip, "gpus": self.gpus}


__all__ = [
    "NOSET_CUDA",
    "EngineActor",
    "EngineLaunch",
    "EngineMember",
    "gpu_ids_here",
    "server_argv",
]

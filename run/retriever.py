"""A retrieval server beside a run: ``palaestra serve-retriever`` started, awaited and stopped.

    server = RetrieverServer(corpus="data/search_quickstart/corpus.jsonl", log_path="r.log")
    await server.wait_ready(timeout_s=120)
    server.url          # http://127.0.0.1:PORT/retrieve, for the env's ``retriever`` kwarg
    server.stop()       # SIGTERM to its process group, SIGKILL after a grace period

The server runs on a free loopback port in its own process group (a Ctrl-C at the terminal
reaches the run, whose cleanup stops it) under this module's watchdog, which ends it as soon as
the process that started it is gone, so a run killed with SIGKILL (no cleanup at all) leaves no
server behind. The watchdog is the server's own main thread's neighbour, started by
``python -m palaestra.run.retriever --parent PID -- serve-retriever ARGS``; it polls the
parent pid rather than using ``PR_SET_PDEATHSIG``, which fires when the *thread* that forked
exits and needs an unsafe ``preexec_fn`` in a process that runs torch threads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from palaestra.envs.search.http import RetrievalError
from palaestra.errors import ConfigError


def free_port() -> int:
    """A TCP port free on loopback right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def retriever_argv(
    *, corpus: str | Path | None, port: int, topk: int = 3, parent: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The command line: ``palaestra serve-retriever`` under the parent watchdog."""
    parent = os.getpid() if parent is None else parent
    argv = [sys.executable, "-m", "palaestra.run.retriever", "--parent", str(parent), "--",
            "serve-retriever", "--host", "127.0.0.1", "--port", str(port), "--topk", str(topk)]
    if corpus is not None:
        argv += ["--corpus", str(corpus)]
    return argv + list(extra)


class RetrieverServer:
    """A ``palaestra serve-retriever`` child process (own process group) and its log."""

    def __init__(
        self, *, corpus: str | Path | None = None, topk: int = 3, log_path: str | Path | None = None,
        extra: Sequence[str] = (),
    ) -> None:
        if corpus is not None and not Path(corpus).is_file():
            raise ConfigError(f"the retriever corpus {str(corpus)!r} does not exist")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/retrieve"
        self.argv = retriever_argv(corpus=corpus, port=self.port, topk=topk, extra=extra)
        self.log_path = Path(log_path) if log_path is not None else None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab") if self.log_path is not None else None
        try:
            out = subprocess.DEVNULL if log is None else log
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            if log is not None:
                log.close()  # the child holds its own descriptor

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, n: int = 2000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until ``/health`` answers; stops the server and raises `RetrievalError` if it exits
        or stays silent for ``timeout_s``."""
        import aiohttp

        health = self.url.rsplit("/", 1)[0] + "/health"
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RetrievalError(
                        f"palaestra serve-retriever exited with code {self.proc.returncode} "
                        f"before answering on {health}; log tail:\n{self.log_tail()}")
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    async with session.get(health) as response:
                        if response.status == 200:
                            return
                await asyncio.sleep(0.2)
        self.stop()
        raise RetrievalError(f"palaestra serve-retriever did not answer on {health} within "
                             f"{timeout_s:.0f} s; log tail:\n{self.log_tail()}")

    def stop(self, grace_s: float = 10.0) -> None:
        """Terminate the server's process group (idempotent)."""
        from palaestra.processes import terminate_process_group

        terminate_process_group(self.proc, grace_s)


# ------------------------------------------------------------------------ the child's side
def _watch_parent(parent: int, interval_s: float) -> None:
    """End this process once ``parent`` is no longer its parent (it died; we were adopted)."""
    while os.getppid() == parent:
        time.sleep(interval_s)
    os.kill(os.getpid(), signal.SIGTERM)  # aiohttp's run_app exits cleanly on SIGTERM
    time.sleep(5.0)
    os._exit(1)  # still here (e.g. stuck in C code): go without cleanup


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m palaestra.run.retriever --parent PID -- COMMAND ARGS`` (a palaestra
    command, normally ``serve-retriever``), ended when PID stops being the parent."""
    parser = argparse.ArgumentParser(prog="python -m palaestra.run.retriever")
    parser.add_argument("--parent", type=int, required=True, help="pid whose death ends us")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between checks")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- palaestra COMMAND ARGS")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the palaestra command after --, e.g. -- serve-retriever --port 8000")
    if os.getppid() != args.parent:
        return 1  # the parent died before we started
    threading.Thread(target=_watch_parent, args=(args.parent, args.interval), daemon=True,
                     name="parent-watchdog").start()
    from palaestra.cli import main as cli_main

    return int(cli_main(list(command)) or 0)


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["RetrieverServer", "free_port", "main", "retriever_argv"]

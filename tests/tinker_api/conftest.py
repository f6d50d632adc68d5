"""A real ``palaestra tinker-server`` on loopback (the tiny model, CPU) for the SDK tests.

The server runs in a thread with its own event loop, the way the command runs it; the tests
talk to it only through the ``tinker`` SDK (or plain HTTP for what the SDK cannot send).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("tinker")

from tinker_testing import API_KEY, BASE

os.environ.setdefault("TINKER_TELEMETRY", "0")



class ServerThread:
    """`start_server` on an event loop of its own thread."""

    def __init__(self, config: Any) -> None:
        from palaestra.tinker_api.listen import start_server

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.running = asyncio.run_coroutine_threadsafe(start_server(config), self.loop
                                                        ).result(timeout=180)
        self.url = self.running.url

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.running.stop(), self.loop).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    import torch

    from palaestra.tiny_model import build_model

    torch.set_num_threads(1)
    return str(build_model(tmp_path_factory.mktemp("tinker-model") / "tiny", "tiny"))


@pytest.fixture(scope="session")
def server(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    from palaestra.tinker_api.server import ServerConfig

    config = ServerConfig(model_dir, (BASE,), port=0, api_key=API_KEY,
                          checkpoint_dir=str(tmp_path_factory.mktemp("tinker-ckpt")),
                          max_batch_datums=64, max_batch_tokens=4096, max_num_samples=16,
                          snapshots_kept=2, poll_timeout_s=5.0)
    srv = ServerThread(config)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def service(server: ServerThread) -> Iterator[Any]:
    import tinker

    client = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    yield client
    client.close("success").result(timeout=30)


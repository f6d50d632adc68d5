"""SGLangEngine's launcher: the sglang command line it builds, GPU groups, the missing-extra error,
and the launch/wait/route/stop path run for real with `palaestra serve` subprocesses."""

from __future__ import annotations

import importlib.util
import socket
import sys

import pytest

from palaestra.errors import ConfigError, EngineError, MissingExtraError
from palaestra.engine import EngineUnavailableError, SamplingParams
from palaestra.engines.serve.serve import serve_argv
from palaestra.engines.clients.server_process import (
    ServerProcess,
    SGLangServerConfig,
    gpu_groups,
    wait_all_ready,
)
from palaestra.engines.clients.sglang import SGLangEngine
from palaestra.engines.clients.sglang_client import SGLangClient
from palaestra.engines.weights.weight_transfer import free_port


def test_sglang_command_line() -> None:
    cfg = SGLangServerConfig("Qwen/Qwen3-0.6B", port=31000, tp_size=2, mem_fraction_static=0.7,
                             gpu_ids=(2, 3), extra_args=("--skip-tokenizer-init",))
    assert cfg.command() == [
        sys.executable, "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen3-0.6B",
        "--tp-size", "2", "--host", "127.0.0.1", "--port", "31000",
        "--mem-fraction-static", "0.7", "--skip-tokenizer-init",
    ]
    assert cfg.env()["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert cfg.url == "http://127.0.0.1:31000"
    with pytest.raises(ConfigError, match="tp_size"):
        SGLangServerConfig("m", tp_size=2, gpu_ids=(0,)).env()


def test_gpu_groups() -> None:
    groups = gpu_groups("m", 8, 2, base_port=40000, mem_fraction_static=0.8)
    assert [g.gpu_ids for g in groups] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [g.port for g in groups] == [40000, 40001, 40002, 40003]
    with pytest.raises(ConfigError, match="groups"):
        gpu_groups("m", 3, 2)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang installed")
async def test_launching_sglang_needs_the_extra() -> None:
    engine = SGLangEngine(servers=[SGLangServerConfig("m")])
    with pytest.raises(MissingExtraError, match=r"palaestra\[sglang\]"):
        await engine.start()


async def test_unreachable_server_is_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    client = SGLangClient(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.01)
    with pytest.raises(EngineUnavailableError, match="is the server running"):
        await client.generate([1, 2], SamplingParams(max_new_tokens=1))
    assert not await client.health()
    await client.close()
    with pytest.raises(EngineError, match="not started"):
        _ = SGLangEngine(f"http://127.0.0.1:{port}").weight_version


async def test_launch_a_server_and_generate(model_dir: str, tmp_path) -> None:
    """The launcher path for real: a `palaestra serve` process started, used, stopped."""
    def launcher(cfg: SGLangServerConfig) -> list[str]:
        return serve_argv(cfg.model_path, port=cfg.port, device="cpu", extra=("--threads", "1"))

    servers = [SGLangServerConfig(model_dir, port=free_port())]
    engine = SGLangEngine(servers=servers, launcher=launcher, log_dir=tmp_path,
                          startup_timeout_s=240, health_interval_s=0)
    async with engine:
        assert await engine.health()
        params = SamplingParams(max_new_tokens=4, temperature=0)
        gens = [await engine.generate([5, 6, 7 + i], params, session_id=f"s{i}")
                for i in range(3)]
        assert {g.meta["engine"] for g in gens} == {servers[0].url}
        assert all(len(g.token_ids) == len(g.logprobs) > 0 for g in gens)
        await engine.update_weights(path=model_dir)
        assert engine.weight_version == 1
        assert (await engine.generate([5, 6, 7], params)).weight_version == 1
        info = await engine.clients[0].get_server_info()
        assert info["engine"] == "palaestra.LocalEngine"
        procs = list(engine.processes)
    assert all(p.proc.poll() is not None for p in procs)  # stopped with the engine
    assert "palaestra serve" in (tmp_path / f"sglang-0-{servers[0].port}.log").read_text()


async def test_one_server_failing_to_start_stops_the_others(tmp_path) -> None:
    """`wait_all_ready`: a server that dies before answering fails the wait with its log, and
    the ones still starting are stopped with it (nothing is left running)."""
    dying = ServerProcess([sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"],
                          "http://127.0.0.1:9", log_path=tmp_path / "dying.log")
    waiting = ServerProcess([sys.executable, "-c", "import time; time.sleep(60)"],
                            "http://127.0.0.1:9", log_path=tmp_path / "waiting.log")
    with pytest.raises(EngineError, match=r"(?s)exited with code 3.*bad flag"):
        await wait_all_ready([dying, waiting], timeout_s=30)
    assert waiting.proc.poll() is not None  # stopped, not left sleeping

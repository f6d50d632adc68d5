"""`[engine] weight_sync`: which path a config resolves to, and the errors for impossible ones.

The paths themselves run end to end in test_loop.py (a separate server process) and
tests/rollout/engines/test_weight_transfer.py; NCCL in test_loop_gpu.py on the device tool.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from palaestra.trainers.config import TrainConfig
from palaestra.trainers.engine_sync import resolve_method

SERVERS = {"kind": "sglang", "urls": ["http://127.0.0.1:30000"]}


def _cfg(**engine: object) -> TrainConfig:
    return TrainConfig.model_validate({"engine": engine})


def test_auto_resolves_by_engine_kind_and_cuda() -> None:
    import torch

    assert resolve_method(_cfg()) == "in_process"
    expected = "distributed" if torch.cuda.is_available() else "disk"
    assert resolve_method(_cfg(**SERVERS)) == expected
    assert resolve_method(_cfg(**SERVERS, weight_sync="tensor")) == "tensor"


@pytest.mark.parametrize(("engine", "message"), [
    ({"weight_sync": "distributed"}, "needs SGLang servers"),
    ({**SERVERS, "weight_sync": "in_process"}, "needs the embedded engine"),
    ({"kind": "sglang"}, "needs engine.urls"),
    ({"launch": "palaestra"}, "set engine.kind = 'sglang'"),
    ({"kind": "sglang", "launch": "sglang", "launch_gpus": [1, 2, 3], "launch_tp": 2},
     "groups of engine.launch_tp"),
])
def test_impossible_paths_are_refused_with_the_fix(engine: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        _cfg(**engine)


def test_nccl_without_cuda_is_a_clear_error() -> None:
    import torch

    from palaestra.errors import ConfigError
    from palaestra.trainers.engine_sync import EngineSync

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")

    class Servers:
        clients = ()

    cfg = _cfg(**SERVERS, weight_sync="distributed", sync_backend="nccl")
    with pytest.raises(ConfigError, match="gloo"):
        EngineSync.from_config(cfg, Servers(), policy_path=None)  # type: ignore[arg-type]


def test_launch_configs_pin_gpu_groups_on_free_ports(tmp_path) -> None:
    from palaestra.trainers.server_launch import palaestra_serve_argv, server_configs

    cfg = _cfg(kind="sglang", launch="sglang", launch_gpus=[1, 2, 3, 4], launch_tp=2,
               launch_args=["--mem-fraction-static", "0.7"])
    servers = server_configs(cfg.engine, tmp_path)
    assert [s.gpu_ids for s in servers] == [(1, 2), (3, 4)]
    assert [s.env()["CUDA_VISIBLE_DEVICES"] for s in servers] == ["1,2", "3,4"]
    assert len({s.port for s in servers}) == 2
    assert servers[0].command()[-2:] == ["--mem-fraction-static", "0.7"]
    (cpu,) = server_configs(_cfg(kind="sglang", launch="palaestra").engine, tmp_path)
    argv = palaestra_serve_argv(cpu)
    assert argv[argv.index("--device") + 1] == "cpu" and cpu.gpu_ids is None

"""`[engine.weight_sync]`: which path a config resolves to, and the errors for impossible ones.

The paths themselves run end to end in test_loop.py (a separate server process) and
tests/engines/test_weight_transfer.py; NCCL in test_loop_gpu.py on a GPU.
"""

from __future__ import annotations

import pytest

from palaestra.config import validate
from palaestra.errors import ConfigError
from palaestra.run.config import TrainConfig
from palaestra.run.fleet.sync_settings import DiskSync, DistributedSync
from palaestra.run.fleet.engine_sync import resolve_method

SERVERS = {"kind": "sglang", "urls": ["http://127.0.0.1:30000"]}


def _cfg(**engine: object) -> TrainConfig:
    return validate(TrainConfig, {"engine": engine})


def test_auto_resolves_by_engine_kind_and_cuda() -> None:
    import torch

    assert resolve_method(_cfg().engine) == "in_process"
    expected = "distributed" if torch.cuda.is_available() else "disk"
    assert resolve_method(_cfg(**SERVERS).engine) == expected
    assert resolve_method(_cfg(**SERVERS, weight_sync={"kind": "tensor"}).engine) == "tensor"


@pytest.mark.parametrize(("engine", "message"), [
    ({"weight_sync": {"kind": "distributed"}}, "needs SGLang servers"),
    ({**SERVERS, "weight_sync": {"kind": "in_process"}}, "needs the embedded engine"),
    ({"kind": "sglang"}, "needs engine.urls"),
    ({"launch": "palaestra"}, "set engine.kind = 'sglang'"),
    ({"kind": "sglang", "launch": "sglang", "launch_gpus": [1, 2, 3], "launch_tp": 2},
     "groups of engine.launch_tp"),
    # weight_sync.kind selects its settings: one the chosen path never reads is refused
    ({**SERVERS, "weight_sync": {"kind": "disk", "backend": "gloo"}},
     ("engine.weight_sync.backend: unknown field; it is a setting of engine.weight_sync.kind "
      "= 'auto' / 'distributed', the 'disk' kind never reads it")),
    ({**SERVERS, "weight_sync": {"kind": "tensor", "dir": "/tmp/w"}},
     ("engine.weight_sync.dir: unknown field; it is a setting of engine.weight_sync.kind = "
      "'auto' / 'disk'")),
    ({"weight_sync": {"bucket_mb": 8}},  # auto, embedded engine
     "the 'in_process' sync of the embedded engine never reads it"),
    ({**SERVERS, "weight_sync": {"kind": "nccl"}},
     ("engine.weight_sync.kind = 'nccl': must be one of 'auto', 'in_process', 'distributed', "
      "'disk', 'tensor'")),
    ({**SERVERS, "weight_sync": {"kind": "disk", "bucket_mb": 0}},
     r"engine.weight_sync.bucket_mb = 0: must be >= 1 \(Size of one transfer bucket"),
])
def test_impossible_paths_are_refused_with_the_fix(engine: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _cfg(**engine)


def test_settings_of_the_chosen_path_and_of_auto_for_servers_are_accepted() -> None:
    d = _cfg(**SERVERS, weight_sync={"kind": "distributed", "backend": "gloo", "bucket_mb": 8,
                                     "timeout_s": 5.0, "dtype": "bfloat16"}).engine.weight_sync
    assert isinstance(d, DistributedSync) and (d.backend, d.bucket_mb) == ("gloo", 8)
    disk = _cfg(**SERVERS, weight_sync={"kind": "disk", "dir": "/tmp/w", "bucket_mb": 8}).engine
    assert isinstance(disk.weight_sync, DiskSync) and disk.weight_sync.dir == "/tmp/w"
    # auto: decided by CUDA at run time, so it carries the settings of both server paths
    auto = _cfg(**SERVERS, weight_sync={"backend": "gloo", "dir": "/tmp/w"}).engine
    resolved_disk = auto.sync_settings("disk")
    assert isinstance(resolved_disk, DiskSync) and resolved_disk.dir == "/tmp/w"
    resolved_dist = auto.sync_settings("distributed")
    assert isinstance(resolved_dist, DistributedSync) and resolved_dist.backend == "gloo"
    _cfg(weight_sync={"dtype": "bfloat16"})  # every path casts
    # the other engine kind's settings stay accepted (a local config switched to servers)
    _cfg(**SERVERS, device="cuda", max_running=64)
    # a resolved config (config.json of a run: every field set, most at their defaults) loads
    resolved = TrainConfig.model_validate({"engine": SERVERS}).model_dump(mode="json")
    TrainConfig.model_validate({**resolved, "engine": {**resolved["engine"], "kind": "local",
                                                        "urls": []}})


def test_nccl_without_cuda_is_a_clear_error() -> None:
    import torch

    from palaestra.errors import ConfigError
    from palaestra.run.fleet.engine_sync import EngineSync

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")

    class Servers:
        clients = ()

    cfg = _cfg(**SERVERS, weight_sync={"kind": "distributed", "backend": "nccl"})
    with pytest.raises(ConfigError, match="gloo"):
        EngineSync.from_config(cfg.engine, Servers(), policy_path=None,  # type: ignore[arg-type]
                               out="runs/x")


def test_launch_configs_pin_gpu_groups_on_free_ports(tmp_path) -> None:
    from palaestra.run.fleet.launch import palaestra_serve_argv, server_configs

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


def test_the_flat_spelling_of_earlier_configs_loads_with_a_deprecation_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r'\[engine.weight_sync\] kind = "disk", '
                      r'dir = "/tmp/w", bucket_mb = 8'):
        engine = _cfg(**SERVERS, weight_sync="disk", sync_dir="/tmp/w", sync_bucket_mb=8).engine
    assert engine.weight_sync == DiskSync(dir="/tmp/w", bucket_mb=8)
    # a resolved config.json of an earlier run sets every flat field; those at their defaults
    # that the chosen path does not read are dropped, one that is not is refused
    flat = {"sync_backend": "nccl", "sync_master_address": "127.0.0.1", "sync_master_port": 0,
            "sync_timeout_s": 600.0, "sync_bucket_mb": 512, "sync_dtype": None,
            "sync_dir": "{out}/engine-weights"}
    with pytest.warns(DeprecationWarning):
        assert _cfg(**SERVERS, weight_sync="disk", **flat).engine.weight_sync == DiskSync()
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="weight_sync.backend"):
        _cfg(**SERVERS, weight_sync="disk", **{**flat, "sync_backend": "gloo"})
    # the resume check re-resolves an earlier run's flat config.json to the current spelling
    from palaestra.run.train import _resolved

    current = _cfg(**SERVERS).model_dump(mode="json")
    recorded = {**current, "engine": {**{k: v for k, v in current["engine"].items()
                                         if k != "weight_sync"}, "weight_sync": "auto", **flat}}
    with pytest.warns(DeprecationWarning):
        assert _resolved(recorded) == current


def test_help_config_lists_every_weight_sync_field_with_the_kinds_that_read_it() -> None:
    from palaestra.config import describe_fields

    lines = [line for line in describe_fields(TrainConfig) if "engine.weight_sync" in line]
    assert lines[0].startswith("--engine.weight_sync.kind (one of 'auto', 'in_process', "
                               "'distributed', 'disk', 'tensor', 'ipc' = 'auto')")
    assert any(line.startswith("--engine.weight_sync.dir (str = '{out}/engine-weights') "
                               "[kind auto / disk]") for line in lines)
    assert any(line.startswith("--engine.weight_sync.dtype (") and "[kind" not in line
               for line in lines)

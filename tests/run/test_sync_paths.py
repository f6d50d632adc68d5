"""`build_push`: one push class per weight-sync path, picked from typed capabilities.

The engines are the real classes (`ScriptedEngine`, `SGLangEngine` over URLs it never contacts
here, `LocalEngine` over the micro model); the backends are the smallest classes that satisfy
the core protocols (`WeightSource`, `AdapterTrainer`) and the trainer group's
`PushesOwnWeights`, since `build_push` reads only their types. The paths themselves run end to
end in test_loop.py, tests/trainers/test_lora_sync.py and tests/engines/test_weight_transfer.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from palaestra.contracts import AdapterTrainer, WeightSource, trains_adapter
from palaestra.engine import AdapterHost, AdapterServing, MemoryReleasing
from palaestra.run.fleet.engine_sync import EngineSync
from palaestra.run.fleet.weight_pushes import (
    AdapterInProcessPush,
    AdapterToServersPush,
    GroupPush,
    SenderPush,
    WholeWeightsPush,
    build_push,
)


class FullWeights:
    """A `WeightSource` training all weights."""

    def state_dict_for_engines(self, *, dtype: Any = None, device: Any = None) -> dict[str, Any]:
        return {}

    def iter_engine_weight_buckets(self, bucket_bytes: int, *, dtype: Any = None,
                                   device: Any = None) -> Any:
        return iter(())


class LoraWeights(FullWeights):
    """An `AdapterTrainer` with an adapter (``lora`` set) or without one (``lora = None``)."""

    def __init__(self, lora: Any = "adapter") -> None:
        self.lora = lora

    def adapter_for_engines(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        return None if self.lora is None else ({}, {})

    def export_adapter(self, directory: str | Path) -> Path:
        return Path(directory)


class Group(FullWeights):
    """A trainer group whose rank 0 sends the weights itself."""

    last_push: dict[str, Any] | None = None

    def push_weights(self, spec: Any, version: int, *, keep: bool = True) -> Any:
        return None


def test_backend_capabilities_are_read_from_types() -> None:
    assert isinstance(FullWeights(), WeightSource) and not trains_adapter(FullWeights())
    assert isinstance(LoraWeights(), AdapterTrainer) and trains_adapter(LoraWeights())
    assert not trains_adapter(LoraWeights(lora=None))  # LoRA off: the whole weights


def test_server_engines_serve_adapters_and_release_memory_through_their_clients() -> None:
    from palaestra.engines.clients.scripted import ScriptedEngine
    from palaestra.engines.clients.sglang import SGLangEngine
    from palaestra.engines.clients.sglang_client import SGLangClient

    servers = SGLangEngine(["http://127.0.0.1:9"], health_interval_s=0)
    assert isinstance(servers, AdapterServing) and not isinstance(servers, AdapterHost)
    assert isinstance(SGLangClient("http://127.0.0.1:9"), MemoryReleasing)
    scripted = ScriptedEngine([1, 2, 3])
    assert not isinstance(scripted, (AdapterHost, AdapterServing))


def test_one_path_per_combination(tmp_path: Path) -> None:
    from palaestra.engines.clients.scripted import ScriptedEngine
    from palaestra.engines.clients.sglang import SGLangEngine
    from palaestra.engines.clients.sglang_client import SGLangClient
    from palaestra.engines.weights.disk_sender import DiskWeightSender

    local = EngineSync("in_process", ScriptedEngine([1]), bucket_bytes=1 << 20)
    assert type(build_push(local, FullWeights())) is WholeWeightsPush
    assert type(build_push(local, LoraWeights())) is WholeWeightsPush  # no adapter host

    servers = SGLangEngine(["http://127.0.0.1:9"], health_interval_s=0)
    tensor = EngineSync("tensor", servers, bucket_bytes=1 << 20)
    assert type(build_push(tensor, FullWeights())) is WholeWeightsPush  # HTTP tensors
    assert type(build_push(tensor, Group())) is GroupPush
    assert type(build_push(tensor, LoraWeights())) is WholeWeightsPush  # merged weights
    tensor.lora_servers, tensor.adapter_dir = True, tmp_path / "lora-sync"
    assert type(build_push(tensor, LoraWeights())) is AdapterToServersPush
    assert type(build_push(tensor, LoraWeights(lora=None))) is WholeWeightsPush

    sender = DiskWeightSender([SGLangClient("http://127.0.0.1:9")], tmp_path / "w")
    disk = EngineSync("disk", servers, sender=sender, bucket_bytes=1 << 20)
    assert type(build_push(disk, FullWeights())) is SenderPush
    assert type(build_push(disk, Group())) is GroupPush


def test_the_embedded_engine_hosts_adapters(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    from palaestra.engines.local.local import LocalEngine
    from palaestra.tiny_model import build_model

    engine = LocalEngine(model_path=str(build_model(tmp_path / "m", "micro")), device="cpu")
    assert isinstance(engine, AdapterHost) and isinstance(engine, MemoryReleasing)
    assert not isinstance(engine, AdapterServing)  # it serves adapters, but has no default
    sync = EngineSync("in_process", engine, bucket_bytes=1 << 20)
    assert type(build_push(sync, LoraWeights())) is AdapterInProcessPush
    assert type(build_push(sync, FullWeights())) is WholeWeightsPush


async def test_the_push_is_built_once_and_keeps_its_timing() -> None:
    from palaestra.engines.clients.scripted import ScriptedEngine

    sync = EngineSync("in_process", ScriptedEngine([1]), bucket_bytes=1 << 20)
    push = build_push(sync, FullWeights())
    assert push.metrics() == {}  # before the first push
    await push.push(1)
    await push.push(2)
    assert push.metrics()["sync/tensors"] == 0.0 and sync.engine.weight_version == 2


def test_lora_to_servers_needs_an_adapter_folder() -> None:
    from palaestra.engines.clients.sglang import SGLangEngine
    from palaestra.errors import ConfigError

    servers = SGLangEngine(["http://127.0.0.1:9"], health_interval_s=0)
    sync = EngineSync("tensor", servers, bucket_bytes=1 << 20, lora_servers=True)
    with pytest.raises(ConfigError, match="run directory"):
        build_push(sync, LoraWeights())

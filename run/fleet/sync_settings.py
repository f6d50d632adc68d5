"""``[engine.weight_sync]``: the settings of each path of the weights to the engines, a section
whose ``kind`` selects them (``auto``, ``in_process``, ``distributed``, ``disk``, ``tensor``,
``ipc``; `EngineSync.from_config` reads them)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, Tag

from palaestra.config import Section


class _SyncSettings(Section):
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Cast floating weights to this dtype on the way (None: as trained), e.g. bfloat16 for
    SGLang servers in bf16."""


class _BucketSettings(_SyncSettings):
    bucket_mb: int = Field(512, ge=1)
    """Size of one transfer bucket (a tensor larger than this goes alone)."""


class _DistributedSettings(_BucketSettings):
    backend: Literal["nccl", "gloo"] = "nccl"
    """Collective of the distributed sync ("gloo" moves CPU tensors, e.g. to a CPU server)."""
    master_address: str = "127.0.0.1"
    """This trainer's address as the servers reach it (rendezvous of the weight-update group)."""
    master_port: int = Field(0, ge=0, le=65535)
    """Port of that rendezvous (0: any free port)."""
    timeout_s: float = Field(600.0, gt=0.0)
    """How long forming the weight-update group and each broadcast may take."""


class _DiskSettings(_BucketSettings):
    dir: str = "{out}/engine-weights"
    """Disk sync: a folder the servers can read ({out} is the run directory)."""


class InProcessSync(_SyncSettings):
    """The embedded engine's tensors are overwritten in the trainer process."""

    kind: Literal["in_process"] = "in_process"


class TensorSync(_SyncSettings):
    """Base64 safetensors over HTTP (``palaestra serve`` only)."""

    kind: Literal["tensor"] = "tensor"


class IpcSync(_BucketSettings):
    """CUDA IPC (or shared-memory) handles through ``/update_weights_from_tensor``, bucketed:
    servers on this host and GPU (colocated) map the trainer's memory; no bytes over HTTP."""

    kind: Literal["ipc"] = "ipc"
    timeout_s: float = Field(600.0, gt=0.0)
    """How long one bucket's request may take."""


class DistributedSync(_DistributedSettings):
    """SGLang's weight-update group: NCCL broadcast (or gloo) from the trainer to the servers."""

    kind: Literal["distributed"] = "distributed"


class DiskSync(_DiskSettings):
    """Safetensors in ``dir`` + /update_weights_from_disk."""

    kind: Literal["disk"] = "disk"


class AutoSync(_DistributedSettings, _DiskSettings):
    """in_process for the embedded engine; for SGLang servers ipc when colocated on this
    host's GPU, distributed when CUDA is here, else disk (so it carries the settings of all)."""

    kind: Literal["auto"] = "auto"

    def resolve(self, method: str) -> WeightSyncSettings:
        """These settings as the concrete path ``method`` (the ones it reads)."""
        variant = SYNC_KINDS[method]
        return variant(**{name: getattr(self, name) for name in variant.model_fields
                          if name != "kind"})


def sync_kind(value: object) -> str | None:
    """The tag of an ``engine.weight_sync`` value (a section without ``kind`` is auto)."""
    if isinstance(value, dict):
        return str(value.get("kind", "auto"))
    return getattr(value, "kind", None)


WeightSyncSettings = (
    Annotated[AutoSync, Tag("auto")] | Annotated[InProcessSync, Tag("in_process")]
    | Annotated[DistributedSync, Tag("distributed")] | Annotated[DiskSync, Tag("disk")]
    | Annotated[TensorSync, Tag("tensor")] | Annotated[IpcSync, Tag("ipc")]
)
SYNC_KINDS: dict[str, Any] = {"auto": AutoSync, "in_process": InProcessSync,
                               "distributed": DistributedSync, "disk": DiskSync,
                               "tensor": TensorSync, "ipc": IpcSync}
#: the flat settings of earlier configs (``engine.sync_dir``) -> their ``engine.weight_sync`` name
FLAT_SYNC = {"sync_backend": "backend", "sync_master_address": "master_address",
              "sync_master_port": "master_port", "sync_bucket_mb": "bucket_mb",
              "sync_dtype": "dtype", "sync_timeout_s": "timeout_s", "sync_dir": "dir"}


__all__ = ["FLAT_SYNC", "SYNC_KINDS", "AutoSync", "DiskSync", "DistributedSync", "InProcessSync",
           "IpcSync", "TensorSync", "WeightSyncSettings", "sync_kind"]

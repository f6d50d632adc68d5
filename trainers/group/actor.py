"""`TrainerRank`: one rank of a trainer group's backend (torch FSDP2 or Megatron-core).

A plain class: `TrainerGroup` runs it as a Ray actor (``ray.remote(TrainerRank)``), and a test or
a one-GPU run can build it in process (world size 1, no Ray). The rank joins the group's process
group through the environment both backends read (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` of rank 0; ``LOCAL_RANK`` 0, since Ray shows an actor only its own
GPU), then builds its backend from the config it gets: a `TorchBackendConfig` (FSDP2 ranks, each
its data-parallel shard) or a `MegatronBackendConfig` (megatron's parallel state from its
tp/pp/ep and the world size; the TP ranks of one data-parallel rank get the same shard). In a
group the batches are local (``local_batches``): each rank gets its data-parallel rank's
sub-batch and that batch's share of the loss weights, computed once over the whole batch.

Every method that runs a collective must be called on all ranks at once; `TrainerGroup` does
that. `push_weights` is one: every rank gathers the full tensors, rank 0 sends them to the
servers (`palaestra.trainers.group.push`).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from palaestra.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from palaestra.trainers.algorithms.config import LossConfig
    from palaestra.trainers.group.push import EnginePushSpec, RankPusher


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def node_address() -> str:
    """This node's IP as the cluster sees it (Ray's view in an actor, else the host's)."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:
        pass
    return "127.0.0.1"


class TrainerRank:
    """One trainer rank (see the module doc)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend: Any = None
        self.kind = ""
        self._pusher: RankPusher | None = None

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port: the rendezvous when this is rank 0."""
        return node_address(), free_port()

    def init(self, model_path: str, config: Any, master_addr: str, master_port: int
             ) -> dict[str, Any]:
        """Join the process group and build this rank's backend; where it runs and its
        data-parallel rank."""
        import torch

        from palaestra.trainers.megatron.config import MegatronBackendConfig

        os.environ.update({"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
                           "LOCAL_RANK": "0", "MASTER_ADDR": master_addr,
                           "MASTER_PORT": str(master_port)})
        threads = int(os.environ.get("OMP_NUM_THREADS") or 1)
        torch.set_num_threads(max(threads, 1))
        if isinstance(config, MegatronBackendConfig):
            self._build_megatron(Path(model_path), config)
        else:
            from palaestra.trainers.torch_backend.backend import TorchBackend

            self.kind = "torch"
            self.backend = TorchBackend(Path(model_path), config)
            self.backend.local_batches = self.world_size > 1
        return {"rank": self.rank, "node": node_address(), "node_id": _node_id(),
                "device": str(self.backend.device), "pid": os.getpid(), "backend": self.kind,
                **self.data_parallel()}

    def _build_megatron(self, model_path: Path, config: Any) -> None:
        from palaestra.trainers.megatron.parallel import require_megatron

        if config.pp > 1 and self.world_size > 1:
            raise ConfigError(
                f"trainer.megatron.pp = {config.pp} in a trainer group: engine weights are "
                "pushed from rank 0, which holds only the first pipeline stage; use tp/ep/dp in "
                "a group, or run pipeline parallelism under torchrun (docs/megatron.md)")
        require_megatron()  # MissingExtraError with the install command
        from transformers import AutoConfig

        from palaestra.trainers.megatron.backend import MegatronBackend

        self.kind = "megatron"
        self.backend = MegatronBackend(AutoConfig.from_pretrained(model_path), config,
                                       model_path=model_path)
        self.backend.local_batches = self.world_size > 1

    def data_parallel(self) -> dict[str, int]:
        """``dp_rank``/``dp_size`` of this rank, and ``dp_leader`` (1 for the one rank of its
        data-parallel rank whose counts the group sums: TP rank 0)."""
        if self.kind == "megatron":
            from megatron.core import parallel_state as ps

            return {"dp_rank": ps.get_data_parallel_rank(),
                    "dp_size": ps.get_data_parallel_world_size(),
                    "dp_leader": int(ps.get_tensor_model_parallel_rank() == 0
                                     and ps.get_pipeline_model_parallel_rank() == 0)}
        return {"dp_rank": self.rank, "dp_size": self.world_size, "dp_leader": 1}

    def train_step(self, shard: tuple[Any, list[Any] | None], loss_cfg: LossConfig
                   ) -> dict[str, float]:
        batch, weights = shard
        return self.backend.train_step(batch, loss_cfg, loss_weights=weights)  # type: ignore[no-any-return]

    def forward_logprobs(self, shard: tuple[Any, list[Any] | None], ref: bool = False
                         ) -> list[Any]:
        return self.backend.forward_logprobs(shard[0], ref=ref)  # type: ignore[no-any-return]

    def state_dict_for_engines(self, dtype: torch.dtype | None = None, device: str = "cpu") -> dict[str, Any]:
        """Full weights (a collective; under FSDP2 only rank 0's dict is filled)."""
        out: dict[str, Any] = self.backend.state_dict_for_engines(dtype=dtype, device=device)
        return out if self.rank == 0 else {}

    def push_weights(self, spec: EnginePushSpec, version: int, keep: bool = True
                     ) -> dict[str, Any]:
        """Gather the full weights with every rank; rank 0 sends them to the servers of
        ``spec`` as ``version`` (or each rank to its own server: `EnginePushSpec.for_rank`).
        A sending rank answers its `TransferStats` and the servers that declined the cache
        flush; the others None."""
        every_rank: dict[str, bool] = {}
        if spec.rank_urls:  # each rank feeds its own server: each needs the full weights
            if not _takes(self.backend.iter_engine_weight_buckets, "every_rank"):
                raise ConfigError(
                    f"{type(self.backend).__name__} ranks cannot each send their weights (ipc "
                    "beside every rank): use engine.weight_sync.kind = 'tensor' or 'disk'")
            every_rank = {"every_rank": True}
        buckets = self.backend.iter_engine_weight_buckets(
            spec.bucket_bytes, dtype=spec.torch_dtype(), device=spec.device(), **every_rank)
        mine = spec.for_rank(self.rank)
        if mine is None:
            for _ in buckets:  # the gathers are collectives: take part, send nothing
                pass
            return {"rank": self.rank, "stats": None, "pid": os.getpid()}
        if self._pusher is None:
            from palaestra.trainers.group.push import RankPusher

            self._pusher = RankPusher()
        stats = self._pusher.push(mine, buckets, version, keep=keep)
        return {"rank": self.rank, "stats": stats, "pid": os.getpid(), "urls": mine.urls,
                "unflushed": self._pusher.unflushed}

    def save(self, directory: str, extra: dict[str, Any] | None = None) -> str:
        return str(self.backend.save(directory, extra=extra))

    def load(self, directory: str) -> dict[str, Any]:
        return self.backend.load(directory)  # type: ignore[no-any-return]

    def export_hf(self, directory: str) -> str:
        return str(self.backend.export_hf(directory))

    def step(self) -> int:
        return int(self.backend.step)

    def offload(self) -> dict[str, float]:
        """Weights, gradients and optimizer state to host memory; GPU memory after, and the
        bytes moved (``offloaded_gib``). A backend without ``offload`` (Megatron's, for now)
        keeps its state where it is (0 moved), as the in-process loop does."""
        from palaestra.trainers.memory import device_state_bytes

        if not hasattr(self.backend, "offload"):
            return {**self.memory(), "offloaded_gib": 0.0}
        moved = device_state_bytes(self.backend)
        self.backend.offload()
        return {**self.memory(), "offloaded_gib": moved / 1024**3}

    def onload(self) -> dict[str, float]:
        if hasattr(self.backend, "onload"):
            self.backend.onload()
        return self.memory()

    def memory(self) -> dict[str, float]:
        from palaestra.trainers.memory import gpu_memory

        if hasattr(self.backend, "memory"):
            return self.backend.memory()  # type: ignore[no-any-return]
        return gpu_memory(self.backend.device)

    def shutdown_pusher(self) -> None:
        """Tear down rank 0's weight-update group (the servers leave it too)."""
        pusher, self._pusher = self._pusher, None
        if pusher is not None:
            pusher.close()

    def shutdown(self) -> None:
        import torch

        self.shutdown_pusher()
        if self.kind == "megatron":
            from palaestra.trainers.megatron.parallel import destroy_parallel

            destroy_parallel()  # megatron's groups, then the default one
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _node_id() -> str | None:
    try:
        import ray

        if ray.is_initialized():
            return str(ray.get_runtime_context().get_node_id())
    except ImportError:
        pass
    return None


def _takes(method: Any, name: str) -> bool:
    import inspect

    return name in inspect.signature(method).parameters


__all__ = ["TrainerRank", "free_port", "node_address"]

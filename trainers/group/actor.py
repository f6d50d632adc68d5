"""`TrainerRank`: one rank of the torch backend inside a Ray actor (see `TrainerGroup`).

The actor joins the group's process group through the environment the torch backend reads
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of rank 0; ``LOCAL_RANK`` 0, since Ray
shows an actor only its own GPU), then builds a `TorchBackend` whose batches are this rank's
data-parallel shard (``local_batches``). Every method that runs a collective must be called on
all ranks at once; `TrainerGroup` does that.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


class TrainerRank:
    """One trainer rank (a plain class; `TrainerGroup` runs it as a Ray actor)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend: Any = None

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port: the rendezvous when this is rank 0."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def init(self, model_path: str, config: Any, master_addr: str, master_port: int) -> dict[str, Any]:
        """Join the process group and build this rank's backend."""
        import ray
        import torch

        os.environ.update({"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
                           "LOCAL_RANK": "0", "MASTER_ADDR": master_addr,
                           "MASTER_PORT": str(master_port)})
        threads = int(os.environ.get("OMP_NUM_THREADS") or 1)
        torch.set_num_threads(max(threads, 1))
        from palaestra.trainers.torch_backend import TorchBackend

        self.backend = TorchBackend(Path(model_path), config)
        self.backend.local_batches = self.world_size > 1
        return {"rank": self.rank, "node": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "device": str(self.backend.device), "pid": os.getpid()}

    def train_step(self, shard: tuple[Any, list[Any]], loss_cfg: Any) -> dict[str, float]:
        batch, weights = shard
        return self.backend.train_step(batch, loss_cfg, loss_weights=weights)  # type: ignore[no-any-return]

    def forward_logprobs(self, shard: tuple[Any, list[Any]], ref: bool = False) -> list[Any]:
        return self.backend.forward_logprobs(shard[0], ref=ref)  # type: ignore[no-any-return]

    def state_dict_for_engines(self, dtype: Any = None, device: str = "cpu") -> dict[str, Any]:
        return self.backend.state_dict_for_engines(dtype=dtype, device=device)  # type: ignore[no-any-return]

    def save(self, directory: str, extra: dict[str, Any] | None = None) -> str:
        return str(self.backend.save(directory, extra=extra))

    def load(self, directory: str) -> dict[str, Any]:
        return self.backend.load(directory)  # type: ignore[no-any-return]

    def export_hf(self, directory: str) -> str:
        return str(self.backend.export_hf(directory))

    def step(self) -> int:
        return int(self.backend.step)

    def offload(self) -> dict[str, float]:
        self.backend.offload()
        return self.backend.memory()  # type: ignore[no-any-return]

    def onload(self) -> dict[str, float]:
        self.backend.onload()
        return self.backend.memory()  # type: ignore[no-any-return]

    def memory(self) -> dict[str, float]:
        return self.backend.memory()  # type: ignore[no-any-return]

    def shutdown(self) -> None:
        import torch

        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


__all__ = ["TrainerRank", "free_port"]

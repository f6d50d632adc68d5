"""Process groups for the Megatron backend: torch.distributed plus megatron's `parallel_state`.

Launched by torchrun (RANK/WORLD_SIZE/LOCAL_RANK set) it joins that job; otherwise it starts a
one-process group on a free loopback port, so a single GPU needs no launcher.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from palaestra.errors import ConfigError, MissingExtraError


@dataclass(frozen=True)
class ParallelConfig:
    """Model-parallel sizes; data parallelism is whatever of the world remains."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    expert_tp: int | None = None  # None: same as tp (megatron's default)
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ParallelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel needs tp > 1")


def require_megatron() -> None:
    """Raise MissingExtraError unless megatron-core is importable."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError.for_module("megatron-core", "megatron") from exc


def init_parallel(parallel: ParallelConfig, *, seed: int = 1234) -> None:
    """Create (once) the default process group and megatron's model-parallel groups."""
    import torch
    import torch.distributed as dist

    require_megatron()
    from megatron.core import parallel_state

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        from palaestra.engines.weights.weight_transfer import free_port

        backend = "nccl" if cuda else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
            )
    world = dist.get_world_size()
    model_parallel = parallel.tp * parallel.pp
    if world % model_parallel:
        raise ConfigError(f"world size {world} is not a multiple of tp*pp = {model_parallel}")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tp,
            pipeline_model_parallel_size=parallel.pp,
            expert_model_parallel_size=parallel.ep,
            expert_tensor_parallel_size=parallel.expert_tp,
        )
    if cuda:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def destroy_parallel() -> None:
    """Tear down megatron's groups and the default group (tests, benchmarks)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()

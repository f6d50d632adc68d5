"""`TinkerServer`: the trainer, the sampling engine, the registry and the futures of one server.

Training work (forward/backward, optimizer steps, adapter exports, checkpoint I/O) runs on one
compute thread in the order requests arrive, which is the order of each client's ``seq_id``s:
the SDK sends a training client's next request only after the previous one was accepted.
Sampling runs in the engine's own thread with continuous batching, so samples of several
clients share batches. `palaestra.tinker_api.listen.start_server` runs the HTTP app inside a
running event loop (tests, notebooks); ``palaestra tinker-server`` (`palaestra.tinker_api.cli`)
runs it as a process.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from palaestra.tinker_api.errors import ApiError
from palaestra.tinker_api.futures import FutureStore
from palaestra.tinker_api.registry import Registry
from palaestra.tinker_api.validate import Limits

if TYPE_CHECKING:
    from palaestra.tinker_api.sampler import SamplerEngine
    from palaestra.tinker_api.trainer import MultiLoraTrainer

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class ServerConfig:
    """What ``palaestra tinker-server`` was started with."""

    model_dir: str
    base_model_names: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    device: str = "cpu"
    dtype: str | None = None
    checkpoint_dir: str | None = None
    max_running: int = 64
    max_batch_datums: int = 1024
    max_batch_tokens: int = 65536
    max_num_samples: int = 128
    snapshots_kept: int = 8
    poll_timeout_s: float = 20.0

    @property
    def names(self) -> tuple[str, ...]:
        """The base model's names: the given ones, then the model folder's absolute path (which
        is also the tokenizer id the SDK loads offline)."""
        path = str(Path(self.model_dir).resolve())
        return tuple(dict.fromkeys((*self.base_model_names, path)))


@dataclass
class TinkerServer:
    """The server's parts (see the module docstring); build with `create`."""

    config: ServerConfig
    trainer: MultiLoraTrainer
    sampler: SamplerEngine
    registry: Registry
    limits: Limits
    futures: FutureStore = field(default_factory=FutureStore)
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tinker-train"))

    @classmethod
    async def create(cls, config: ServerConfig) -> TinkerServer:
        """Load the model for training and for sampling (on a worker thread)."""
        import tempfile

        from palaestra.tinker_api.sampler import SamplerEngine
        from palaestra.tinker_api.trainer import MultiLoraTrainer

        if not (Path(config.model_dir) / "config.json").is_file():
            raise ApiError(f"{config.model_dir} is not a Hugging Face model folder "
                           "(no config.json); make one with palaestra init-model")
        trainer = await asyncio.to_thread(MultiLoraTrainer, config.model_dir, config.device,
                                          config.dtype)
        sampler = await asyncio.to_thread(SamplerEngine.build, config.model_dir, config.device,
                                          config.max_running)
        root = Path(config.checkpoint_dir or tempfile.mkdtemp(prefix="tinker-checkpoints-"))
        limits = Limits(sampler.vocab_size, sampler.max_context, config.max_batch_datums,
                        config.max_batch_tokens, config.max_num_samples,
                        max_sample_tokens=sampler.max_context)
        return cls(config, trainer, sampler, Registry(root), limits)

    def base_model(self, name: str | None) -> str:
        """A served base model name (refused: any other)."""
        if name is None or name not in self.config.names:
            raise ApiError(f"base_model {name!r} is not served; this server serves "
                           f"{', '.join(self.config.names)}")
        return name

    async def compute(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """``fn(*args, **kwargs)`` on the training thread, after the work queued before it."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    async def close(self) -> None:
        await self.futures.close()
        await self.sampler.close()
        self.executor.shutdown(wait=False, cancel_futures=True)


__all__ = ["ServerConfig", "TinkerServer"]

"""Weights from a trainer group's rank 0 straight to the inference servers.

With SGLang-compatible servers (``engine.kind = "sglang"``: SGLang or ``palaestra serve``) the
driver does not relay the weights: `EngineSync` hands the group an `EnginePushSpec` (the sync
path of ``[engine.weight_sync]`` and the servers' URLs, a few hundred bytes), every rank gathers
the full tensors collectively (FSDP2 all-gathers, Megatron's TP/EP gathers) and rank 0's
`RankPusher` sends them by that path: it joins the servers' weight-update group as its rank 0
(``/init_weights_update_group`` + ``/update_weights_from_distributed``: NCCL, or gloo to a CPU
server), or writes a version folder for ``/update_weights_from_disk``, or posts HTTP tensors. The
driver only coordinates: it pauses generation, tells the group to push version v, reads the
servers' versions back and resumes.

`RankPusher` keeps its weight-update group across pushes (a new one forms when the servers
change: an engine joined or left) and tears it down in `close`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from palaestra.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Iterable

    from palaestra.engines.weights.weight_transfer import Bucket, TransferStats

REMOTE_METHODS = ("distributed", "disk", "tensor", "ipc")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class EnginePushSpec:
    """Where and how the ranks send the weights (picklable: it travels to the ranks' processes):
    rank 0 to every server, or each rank to its own (`for_rank`)."""

    method: str  # distributed | disk | tensor
    urls: tuple[str, ...]
    bucket_bytes: int
    dtype: str | None = None  # torch dtype name the floating weights are cast to
    backend: str = "gloo"  # distributed: nccl | gloo
    master_address: str = "127.0.0.1"
    master_port: int = 0
    timeout_s: float = 600.0
    directory: str | None = None  # disk: the versions' folder (the servers must see it)
    model_dir: str | None = None  # disk: config and tokenizer files copied beside the weights
    tp_sizes: tuple[int, ...] = ()  # tensor: each server's TP size (one payload per TP rank)
    # ipc beside a trainer group (a colocated plan): rank r's own server, on rank r's GPU; each
    # rank holds the gathered weights, so each hands its GPU's copy to its neighbour
    rank_urls: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.method not in REMOTE_METHODS:
            raise ConfigError(f"a trainer group pushes by {REMOTE_METHODS}, not {self.method!r}")
        if self.rank_urls and self.method != "ipc":
            raise ConfigError("rank_urls (a server per rank) is for the ipc path only")
        if not self.urls:
            raise ConfigError("a weight push needs at least one server URL")
        if self.method == "disk" and not self.directory:
            raise ConfigError("a disk push needs a directory the servers can read")

    def for_rank(self, rank: int) -> EnginePushSpec | None:
        """What trainer rank ``rank`` sends, None for nothing: rank 0 sends to every server,
        except that with ``rank_urls`` each rank sends to its own neighbour (and rank 0 also to
        any server that is no rank's neighbour, e.g. one that joined later)."""
        if not self.rank_urls:
            return self if rank == 0 else None
        mine = (self.rank_urls[rank],) if rank < len(self.rank_urls) else ()
        rest = tuple(u for u in self.urls if u not in self.rank_urls) if rank == 0 else ()
        urls = mine + rest
        if not urls:
            return None
        tp = dict(zip(self.urls, self.tp_sizes, strict=False))
        return replace(self, urls=urls, rank_urls=(),
                       tp_sizes=tuple(tp.get(u, 1) for u in urls) if self.tp_sizes else ())

    def only(self, url: str, tp_size: int = 1) -> EnginePushSpec:
        """The same path to one server alone (an engine that joins a running run), through a
        group of its own on a free port."""
        return replace(self, urls=(url,), master_port=0,
                       tp_sizes=(tp_size,) if self.tp_sizes else ())

    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.dtype) if self.dtype else None

    def device(self) -> str:
        """Where the gathered tensors go before sending: CUDA for NCCL and for IPC handles
        (a colocated server maps them on the same GPU), else host memory."""
        if self.method == "ipc":  # CPU ranks: shared-memory handles of host tensors
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        return "cuda" if self.method == "distributed" and self.backend == "nccl" else "cpu"


@runtime_checkable
class PushesOwnWeights(Protocol):
    """A backend whose own process sends its weights to the servers (a `TrainerGroup`);
    ``last_push`` is rank 0's answer to the last push (``unflushed``: servers that kept their
    prefix cache)."""

    last_push: dict[str, Any] | None

    def push_weights(self, spec: EnginePushSpec, version: int, *, keep: bool = True
                     ) -> TransferStats:
        """Every rank gathers, rank 0 sends ``version`` by ``spec``; rank 0's timing."""
        ...


class RankPusher:
    """Rank 0's sender: one event loop and one sender per set of servers, kept across pushes."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._spec: EnginePushSpec | None = None
        self._sender: Any = None
        self._clients: list[Any] = []
        self.pushes = 0
        self.unflushed = 0

    def push(self, spec: EnginePushSpec, buckets: Iterable[Bucket], version: int, *,
             keep: bool = True) -> TransferStats:
        """Send ``buckets`` as ``version``; ``keep=False``: a one-off sender (closed after)."""
        if not keep:
            once = RankPusher()
            try:
                return once.push(spec, buckets, version)
            finally:
                once.close()
        return self._loop.run_until_complete(self._push(spec, buckets, version))

    async def _push(self, spec: EnginePushSpec, buckets: Iterable[Bucket], version: int
                    ) -> TransferStats:
        if spec != self._spec:
            await self._close_sender()
            self._make_sender(spec)
        self.pushes += 1
        if self._sender is None:  # tensor: one HTTP payload per server, the whole model
            return await self._push_tensors(buckets, version)
        stats: TransferStats = await self._sender.push(buckets, version)
        self.unflushed = int(getattr(self._sender, "unflushed", 0))
        return stats

    def _make_sender(self, spec: EnginePushSpec) -> None:
        from palaestra.engines.clients.sglang_client import SGLangClient
        from palaestra.engines.weights.disk_sender import DiskWeightSender
        from palaestra.engines.weights.weight_transfer import (
            DistributedWeightSender,
            IpcWeightSender,
        )

        tp = spec.tp_sizes or (1,) * len(spec.urls)
        self._clients = [SGLangClient(u, tp_size=t) for u, t in zip(spec.urls, tp, strict=True)]
        self._spec = spec
        if spec.method == "distributed":
            self._sender = DistributedWeightSender(
                self._clients, backend=spec.backend, master_address=_reachable(spec),
                master_port=spec.master_port, timeout_s=spec.timeout_s)
        elif spec.method == "disk":
            assert spec.directory is not None  # checked by the spec
            self._sender = DiskWeightSender(self._clients, spec.directory,
                                            model_dir=spec.model_dir, keep_last=2)
        elif spec.method == "ipc":
            self._sender = IpcWeightSender(self._clients, timeout_s=spec.timeout_s)
        else:
            self._sender = None

    async def _push_tensors(self, buckets: Iterable[Bucket], version: int) -> TransferStats:
        import time

        from palaestra.engines.weights.weight_transfer import TransferStats

        start = time.perf_counter()
        weights = {name: t for bucket in buckets for name, t in bucket}
        await asyncio.gather(*(c.update_weights(weights, version=version)
                               for c in self._clients))
        unique = {t.data_ptr(): t for t in weights.values()}.values()  # tied weights once
        return TransferStats(time.perf_counter() - start,
                             sum(t.numel() * t.element_size() for t in unique), len(weights), 1)

    async def _close_sender(self) -> None:
        sender, self._sender, self._spec = self._sender, None, None
        if sender is not None:
            await sender.close()
        clients, self._clients = self._clients, []
        for client in clients:
            await client.close()

    def close(self) -> None:
        """Tear down the weight-update group (on the servers too) and the loop."""
        if self._loop.is_closed():
            return
        try:
            self._loop.run_until_complete(self._close_sender())
        finally:
            self._loop.close()


def _reachable(spec: EnginePushSpec) -> str:
    """The rendezvous address the servers dial: the configured one, except that a loopback
    default on a rank whose servers are on other hosts becomes this node's address."""
    from urllib.parse import urlparse

    if spec.master_address not in LOOPBACK:
        return spec.master_address
    hosts = {urlparse(u).hostname for u in spec.urls}
    if hosts <= set(LOOPBACK):
        return spec.master_address
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except ImportError:
        import socket

        return socket.gethostbyname(socket.gethostname())


__all__ = ["REMOTE_METHODS", "EnginePushSpec", "PushesOwnWeights", "RankPusher"]

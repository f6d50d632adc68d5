"""Push trained weights to SGLang-compatible servers: NCCL/gloo broadcast, handles, or disk.

The senders take HF-named buckets (lists of ``(name, tensor)``, see `bucketize`) and a version:

* `DistributedWeightSender` is the trainer side of SGLang's ``/init_weights_update_group`` +
  ``/update_weights_from_distributed``: one process group (rank 0 = this trainer, then each
  server's TP ranks), one HTTP request per bucket announcing names/dtypes/shapes while the
  tensors are broadcast. "nccl" moves CUDA tensors GPU to GPU; "gloo" moves CPU tensors (a CPU
  `palaestra serve`, and the tests).
* `IpcWeightSender` is the colocated path (``/update_weights_from_tensor`` with CUDA IPC or
  shared-memory handles, SGLang's ``MultiprocessingSerializer`` format): servers on this host map
  the trainer's memory and copy out of it, one bucket at a time.
* `DiskWeightSender` is the fallback that needs only a shared filesystem: safetensors files plus
  the model's config and tokenizer files in ``<directory>/v<version>``, then
  ``/update_weights_from_disk`` on every server; older versions are pruned.

Each ``push`` returns a `TransferStats`; the servers' weight version is the pushed version.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from palaestra.asyncio_utils import in_daemon_thread
from palaestra.engines.weights.weight_group import DEFAULT_GROUP_NAME, dtype_name
from palaestra.errors import ConfigError, EngineError

if TYPE_CHECKING:
    import torch

    from palaestra.engines.clients.sglang_client import SGLangClient

Bucket = list[tuple[str, "torch.Tensor"]]


@dataclass(frozen=True)
class TransferStats:
    """One push: wall time (device synchronised), bytes, tensors and buckets moved."""

    seconds: float
    num_bytes: int
    num_tensors: int
    num_buckets: int

    @property
    def gbytes_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def as_metrics(self, prefix: str = "sync/") -> dict[str, float]:
        return {f"{prefix}seconds": self.seconds, f"{prefix}gbytes": self.num_bytes / 1e9,
                f"{prefix}tensors": float(self.num_tensors),
                f"{prefix}buckets": float(self.num_buckets)}


def bucketize(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group (name, tensor) pairs into lists of at most ``bucket_bytes`` (a bigger tensor alone)."""
    if bucket_bytes <= 0:
        raise ConfigError("bucket_bytes must be positive")
    bucket: Bucket = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (for the group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _check(out: Any, what: str, url: str) -> None:
    if not (isinstance(out, dict) and out.get("success")):
        message = out.get("message") if isinstance(out, dict) else out
        raise EngineError(f"{url} refused {what}: {message}")


class DistributedWeightSender:
    """Rank 0 of SGLang's weight-update group; `connect` once, `push` after every step.

    ``backend`` "nccl" sends from ``device`` (a CUDA device of this process); "gloo" from the CPU.
    ``master_port`` 0 picks a free port. The servers must reach ``master_address``. The group
    name gets a per-sender suffix, so servers still holding the group of a crashed trainer do
    not refuse the resumed one.
    """

    def __init__(self, clients: Sequence[SGLangClient], *, backend: str = "nccl",
                 master_address: str = "127.0.0.1", master_port: int = 0,
                 group_name: str | None = None, device: torch.device | str | None = None,
                 timeout_s: float = 600.0) -> None:
        if not clients:
            raise ConfigError("DistributedWeightSender needs at least one server")
        if backend not in ("nccl", "gloo"):
            raise ConfigError(f"backend {backend!r}: use 'nccl' (GPU) or 'gloo' (CPU)")
        self.clients = list(clients)
        self.backend = backend
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name or f"{DEFAULT_GROUP_NAME}_{uuid.uuid4().hex[:8]}"
        self.device = device
        self.timeout_s = timeout_s
        self.group: Any = None
        self.world_size = 0
        self.unflushed = 0  # servers that declined the last push's cache flush

    async def connect(self) -> None:
        """Create the group: every server joins (rank offsets by TP size) while this side hosts."""
        import torch

        from palaestra.engines.weights.weight_group import init_weight_group

        if self.group is not None:
            return
        infos = await asyncio.gather(*(c.get_server_info() for c in self.clients))
        for client, info in zip(self.clients, infos, strict=True):
            for key in ("dp_size", "pp_size"):
                if int(info.get(key, 1) or 1) > 1:
                    raise ConfigError(
                        f"{client.url} runs {key}={info[key]}: SGLang's weight-update group "
                        "ranks a server by its TP rank only; launch one server per data- or "
                        "pipeline-parallel replica and list each URL, or use weight_sync = 'disk'")
        tp_sizes = [int(info.get("tp_size", 1) or 1) for info in infos]
        self.world_size = 1 + sum(tp_sizes)
        port = self.master_port or free_port(self.master_address)
        offsets = [1 + sum(tp_sizes[:i]) for i in range(len(self.clients))]
        if self.backend == "nccl":
            self.device = (torch.device(self.device) if self.device is not None
                           else torch.device("cuda", torch.cuda.current_device()))
        joins = [asyncio.create_task(c.init_weights_update_group(
            master_address=self.master_address, master_port=port, rank_offset=off,
            world_size=self.world_size, group_name=self.group_name, backend=self.backend,
            timeout_s=self.timeout_s))
            for c, off in zip(self.clients, offsets, strict=True)]
        # a daemon thread: a rendezvous left waiting by a refusing server must not hold up exit
        host = asyncio.ensure_future(in_daemon_thread(
            init_weight_group, backend=self.backend, master_address=self.master_address,
            master_port=port, world_size=self.world_size, rank=0, group_name=self.group_name,
            timeout_s=self.timeout_s))
        try:
            # a server that cannot join answers at once: fail then, not at the store's timeout
            self.group = await self._with_answers(host, joins, "/init_weights_update_group")
        except (RuntimeError, ValueError, OSError, EngineError) as exc:
            raise EngineError(
                f"the weight-update group at {self.master_address}:{port} did not form: {exc}; "
                "check that every server can reach master_address") from exc

    async def push(self, buckets: Iterable[Bucket], version: int) -> TransferStats:
        """Broadcast every bucket (one request per bucket and server), then flush the caches.

        Tied weights (one tensor under two names) travel once. A server that refuses or dies
        mid-bucket aborts the group (the next push forms a new one) and raises `EngineError`.
        """
        from palaestra.engines.weights.weight_group import broadcast_tensors

        await self.connect()
        _synchronize()
        start = time.perf_counter()
        nbytes = ntensors = nbuckets = 0
        seen = _Seen()
        for bucket in buckets:
            unique = seen.new(bucket)
            if not unique:
                continue
            tensors = [self._on_wire(t) for _, t in unique]
            requests = [asyncio.create_task(c.update_weights_from_distributed(
                names=[n for n, _ in unique], dtypes=[dtype_name(t.dtype) for t in tensors],
                shapes=[list(t.shape) for t in tensors], group_name=self.group_name,
                version=version, timeout_s=self.timeout_s)) for c in self.clients]
            sending = asyncio.ensure_future(in_daemon_thread(broadcast_tensors, self.group,
                                                             tensors))
            try:
                await self._with_answers(sending, requests, "/update_weights_from_distributed")
            except BaseException:
                await self._abandon_group()  # the broadcast may be stuck waiting for that server
                raise
            nbuckets += 1
            ntensors += len(tensors)
            nbytes += sum(t.numel() * t.element_size() for t in tensors)
        flushed = await asyncio.gather(*(c.flush_cache_quietly() for c in self.clients))
        self.unflushed = len(flushed) - sum(flushed)
        _synchronize()
        return TransferStats(time.perf_counter() - start, nbytes, ntensors, nbuckets)

    async def _with_answers(self, own: asyncio.Future[Any], requests: list[asyncio.Task[Any]],
                            what: str) -> Any:
        """``own``'s result once it and every server's answer to ``what`` are in; the first
        failure (a refusal, an exception) raises at once, cancelling the rest."""
        pending: set[asyncio.Future[Any]] = {own, *requests}
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task is own:
                        task.result()  # raises what the own side raised
                    else:
                        client = self.clients[requests.index(task)]  # type: ignore[arg-type]
                        _check(task.result(), what, client.url)
            return own.result()
        except BaseException:
            for task in requests:
                task.cancel()
            own.add_done_callback(_discard_result)  # may stay blocked in its daemon thread
            raise

    async def _abandon_group(self) -> None:
        """Drop a group a failed push left in an unknown state; the next push forms a new one
        under a new name (servers that keep the old one cannot refuse it)."""
        group, self.group = self.group, None
        abort = getattr(group, "abort", None)
        if abort is not None:
            try:
                abort()  # NCCL: ends the blocked broadcast instead of waiting for its watchdog
            except RuntimeError:
                pass
        old, self.group_name = self.group_name, f"{DEFAULT_GROUP_NAME}_{uuid.uuid4().hex[:8]}"
        cleanup = asyncio.gather(*(c.destroy_weights_update_group(old) for c in self.clients),
                                 return_exceptions=True)
        try:
            await asyncio.wait_for(cleanup, timeout=5.0)
        except asyncio.TimeoutError:
            pass  # a server stuck in its teardown keeps a stale group; the new name avoids it

    def _on_wire(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.backend == "gloo":
            return tensor.detach().cpu()
        return tensor.detach().to(self.device, non_blocking=True)

    async def close(self) -> None:
        """Destroy the group on the servers and here (a dead server is skipped)."""
        from palaestra.engines.weights.weight_group import destroy_weight_group

        if self.group is None:
            return
        group, self.group = self.group, None
        # both sides at once: tearing down an NCCL communicator can wait for its peers, so a
        # trainer that waited for the servers' answers before its own teardown would deadlock
        await asyncio.gather(in_daemon_thread(destroy_weight_group, group),
                             *(c.destroy_weights_update_group(self.group_name)
                               for c in self.clients), return_exceptions=True)


class _Seen:
    """Tensors already sent in one push, tracked by weak reference: a freed temporary whose
    address a later tensor reuses is not mistaken for it, and nothing is kept alive."""

    def __init__(self) -> None:
        self._by_ptr: dict[int, weakref.ref[torch.Tensor]] = {}

    def new(self, bucket: Bucket) -> Bucket:
        out = []
        for name, tensor in bucket:
            ptr = tensor.data_ptr()
            ref = self._by_ptr.get(ptr)
            old = ref() if ref is not None else None
            if old is not None and old.shape == tensor.shape and old.dtype == tensor.dtype:
                continue  # the same storage under a second name (tied embeddings)
            self._by_ptr[ptr] = weakref.ref(tensor)
            out.append((name, tensor))
        return out


def _discard_result(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: no "exception was never retrieved" at exit


class IpcWeightSender:
    """``/update_weights_from_tensor`` with handles, bucket by bucket: trainer and servers share
    the host (and, for CUDA tensors, the GPU), so the servers map the trainer's memory and copy
    out of it; nothing crosses the wire but a pickle of handles (see `ipc_payload`).

    Each bucket is one request per server; the bucket's tensors (and any temporary copies the
    bucketing made) stay alive until every server answered, then go, so the extra memory is one
    bucket at most. The prefix caches are flushed after the last bucket.
    """

    def __init__(self, clients: Sequence[SGLangClient], *, timeout_s: float = 600.0) -> None:
        if not clients:
            raise ConfigError("IpcWeightSender needs at least one server")
        self.clients = list(clients)
        self.timeout_s = timeout_s
        self.unflushed = 0

    async def connect(self) -> None:
        """Refuse servers that cannot map this host's memory (another host by URL)."""
        for client in self.clients:
            if not on_this_host(client.url):
                raise ConfigError(
                    f"{client.url} is not on this host: CUDA IPC / shared-memory handles only "
                    "open on the same machine; use engine.weight_sync.kind = 'distributed' "
                    "(NCCL) or 'disk' for servers elsewhere")

    async def push(self, buckets: Iterable[Bucket], version: int) -> TransferStats:
        from palaestra.engines.weights.ipc_payload import encode_ipc_named_tensors

        await self.connect()
        _synchronize()
        start = time.perf_counter()
        nbytes = ntensors = nbuckets = 0
        seen = _Seen()
        for bucket in buckets:
            unique = seen.new(bucket)
            if not unique:
                continue
            payload, alive = encode_ipc_named_tensors(unique)
            _synchronize()  # the handles point at finished values (casts, gathers)
            answers = await asyncio.gather(*(c.update_weights_from_tensor(
                payload, version=version, timeout_s=self.timeout_s) for c in self.clients))
            for client, out in zip(self.clients, answers, strict=True):
                _check(out, "/update_weights_from_tensor", client.url)
            nbuckets += 1
            ntensors += len(unique)
            nbytes += sum(t.numel() * t.element_size() for _, t in unique)
            del alive, payload, unique, bucket  # every server copied them: free the bucket
        flushed = await asyncio.gather(*(c.flush_cache_quietly() for c in self.clients))
        self.unflushed = len(flushed) - sum(flushed)
        _release_ipc()
        _synchronize()
        return TransferStats(time.perf_counter() - start, nbytes, ntensors, nbuckets)

    async def close(self) -> None:
        _release_ipc()


def on_this_host(url: str) -> bool:
    """Whether ``url``'s host is this machine (loopback, its name, or one of its addresses)."""
    from urllib.parse import urlparse

    host = urlparse(url if "//" in url else f"//{url}").hostname or ""
    if host in ("localhost", "::1", "0.0.0.0", socket.gethostname()) or host.startswith("127."):
        return True
    try:
        mine = {str(a[4][0]) for a in socket.getaddrinfo(socket.gethostname(), None)}
        return socket.gethostbyname(host) in mine
    except OSError:
        return False


def _release_ipc() -> None:
    """Free CUDA blocks whose IPC mappings the servers closed (torch keeps them until then)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()


__all__ = [
    "DistributedWeightSender",
    "IpcWeightSender",
    "TransferStats",
    "bucketize",
    "free_port",
    "on_this_host",
]

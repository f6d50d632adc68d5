"""``DockerSandbox``: each stateless run in a fresh container; sessions keep one container.

Containers come from a warm pool (pre-created and started, the in-sandbox agent already
listening on the attach socket), so a run pays one fork inside an existing container, not a
container start. Every container: ``network_mode="none"``, read-only root with tmpfs
``/workspace`` and ``/tmp``, a non-root user, all capabilities dropped, ``no-new-privileges``,
memory (swap included), CPU and pids limits, and ``auto_remove`` plus an owner label so that
nothing survives the sandbox (stale containers of dead owners are removed at start). A used
container is discarded and replaced in the background; no state crosses runs.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

from palaestra.errors import MissingExtraError, SandboxError
from palaestra.processes import pid_alive
from palaestra.sandbox.base import Sandbox
from palaestra.sandbox.isolation import DEV_FILES, clean_env
from palaestra.sandbox.outcome import result_from_frame
from palaestra.sandbox.requests import ZygoteRequests, file_reply
from palaestra.sandbox.result import ExecResult
from palaestra.sandbox.shipping import runtime_argv
from palaestra.sandbox.spec import RunSpec
from palaestra.sandbox.zygote import ZygoteClient, ZygoteDied

MIB = 1024 * 1024
LABEL = "palaestra.sandbox"
OWNER_LABEL = "palaestra.sandbox.owner"
HOST_GRACE_S = 15.0
WORKSPACE = "/workspace"
#: OOM-kill counters of the container's memory cgroup (v1, v2), read by the agent.
OOM_EVENT_FILES = ("/sys/fs/cgroup/memory/memory.oom_control", "/sys/fs/cgroup/memory.events")


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class DockerZygote(ZygoteClient):
    """The agent inside one container, over the container's hijacked attach socket."""

    def __init__(self, name: str, container_id: str, sock: socket.socket) -> None:
        super().__init__(name)
        self.container_id = container_id
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._demux = bytearray()
        self._ready = self._loop.create_future()
        sock.setblocking(False)
        self._loop.add_reader(sock.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        try:
            data = self._sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.fail(f"container connection failed: {exc}")
            return
        if not data:
            self.fail("container exited")
            return
        # Docker multiplexes stdout/stderr: 8-byte header (stream, 0, 0, 0, big-endian size).
        self._demux += data
        while len(self._demux) >= 8:
            stream = self._demux[0]
            (size,) = struct.unpack_from(">I", self._demux, 4)
            if len(self._demux) < 8 + size:
                break
            payload = bytes(self._demux[8:8 + size])
            del self._demux[:8 + size]
            if stream == 1:
                self.feed(payload)
            else:
                self.log_tail.append(payload.decode("utf-8", "replace").rstrip())
            if self.closed:
                return

    def _write_some(self, data: bytes | bytearray) -> int:
        return self._sock.send(data)

    def _want_write(self, on: bool) -> None:
        if on:
            self._loop.add_writer(self._sock.fileno(), self.on_writable)
        else:
            self._loop.remove_writer(self._sock.fileno())

    def _close_transport(self) -> None:
        try:
            self._loop.remove_reader(self._sock.fileno())
            self._loop.remove_writer(self._sock.fileno())
        except (ValueError, OSError):
            pass
        self._sock.close()


@dataclass
class _DockerSession:
    zyg: DockerZygote
    persistent: bool
    sid: str = "session"
    had_kernel: bool = False


class DockerSandbox(Sandbox):
    """Runs code in containers of a locally built image (see scripts/build_sandbox_image.sh)."""

    backend_name = "docker"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._client: Any = None
        self._pool: asyncio.Queue[DockerZygote] | None = None
        self._refills: set[asyncio.Task[None]] = set()
        self._live: dict[str, DockerZygote] = {}
        self._init_opts: dict[str, Any] = {}
        self._seccomp = b""
        # the container's pids limit bounds processes: no RLIMIT_NPROC
        self._requests = ZygoteRequests(self.config, count_processes=False)
        self.mode: dict[str, Any] = {}
        self._filling = 0

    # -- lifecycle
    async def _start(self) -> None:
        try:
            import docker
        except ImportError as exc:
            raise MissingExtraError.for_module("docker", "docker") from exc
        cfg = self.config

        def connect() -> Any:
            client = docker.DockerClient(base_url=cfg.docker_url) if cfg.docker_url \
                else docker.from_env()
            client.ping()
            return client

        try:
            self._client = await asyncio.to_thread(connect)
        except Exception as exc:
            raise SandboxError(f"no Docker engine reachable ({exc}); start one, e.g. "
                               "`dockerd --bridge=none --iptables=false &`") from exc
        try:
            await asyncio.to_thread(self._client.images.get, cfg.image)
        except docker.errors.ImageNotFound as exc:
            raise SandboxError(f"Docker image {cfg.image!r} not found; build it with "
                               "scripts/build_sandbox_image.sh (no registry needed)") from exc
        await asyncio.to_thread(self._remove_stale)
        from palaestra.sandbox.seccomp import build_filter_bpf

        self._seccomp = await asyncio.to_thread(build_filter_bpf)
        env = clean_env()
        env.update(cfg.env)
        self._init_opts = {"ro_paths": ["/"], "dev_files": list(DEV_FILES), "env": env,
                           "max_output": cfg.max_output_bytes, "pidns": False,
                           "drop_caps": False, "landlock": True,
                           "oom_events": list(OOM_EVENT_FILES)}
        self._pool = asyncio.Queue()
        first = await self._new_container()  # fail loudly here if containers cannot start
        self._pool.put_nowait(first)
        feats = first.features
        self.mode = {"image": cfg.image, "container_user": cfg.docker_user,
                     "landlock_abi": feats.get("landlock_abi", 0), "seccomp": bool(self._seccomp),
                     "agent_is_pid1": feats.get("pid") == 1, "network": "none",
                     "read_only_root": True, "cap_drop": "ALL"}
        for _ in range(cfg.docker_pool_size - 1):
            self._refill()

    async def _rebind(self) -> None:
        """Containers attached on a previous event loop are removed; new ones start here."""
        stale = list(self._live.values())
        self._live.clear()
        self._refills = set()
        self._filling = 0
        for zyg in stale:
            zyg.closed = True
            zyg._sock.close()

        def remove_all() -> None:
            for zyg in stale:
                try:
                    self._client.api.remove_container(zyg.container_id, force=True)
                except Exception:
                    pass

        await asyncio.to_thread(remove_all)
        self._pool = asyncio.Queue()
        self._refill()

    def _remove_stale(self) -> None:
        """Containers left by owners that died (this host, pid gone)."""
        host = socket.gethostname()
        for c in self._client.containers.list(all=True, filters={"label": LABEL}):
            owner = (c.labels or {}).get(OWNER_LABEL, "")
            name, _, pid = owner.partition(":")
            if name == host and pid.isdigit() and not pid_alive(int(pid)):
                try:
                    c.remove(force=True)
                except Exception:
                    pass

    def _create(self) -> tuple[str, socket.socket]:
        cfg = self.config
        api = self._client.api
        mem = (cfg.memory_mb + 128) * MIB  # per-run RLIMIT_AS is memory_mb; room for the agent
        host_config = api.create_host_config(
            network_mode="none", read_only=True, auto_remove=True,
            tmpfs={WORKSPACE: f"rw,exec,size={cfg.workspace_mb}m,mode=1777",
                   "/tmp": "rw,size=16m,mode=1777"},
            mem_limit=mem, memswap_limit=mem, pids_limit=cfg.max_processes + 16,
            nano_cpus=int(cfg.docker_cpus * 1e9), cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            ulimits=[{"Name": "nofile", "Soft": cfg.max_open_files, "Hard": cfg.max_open_files},
                     {"Name": "core", "Soft": 0, "Hard": 0}])
        # the image has the standard library only: other preloads fail quietly in the agent
        opts = {"stdio": True, "preload": list(cfg.preload)}
        cmd = runtime_argv("python3", opts, no_site=False)
        created = api.create_container(
            cfg.image, command=cmd, user=cfg.docker_user, stdin_open=True, detach=False,
            working_dir=WORKSPACE, environment=clean_env(), host_config=host_config,
            labels={LABEL: "1", OWNER_LABEL: _owner()}, network_disabled=True)
        cid = created["Id"]
        try:
            raw = api.attach_socket(cid, params={"stdin": 1, "stdout": 1, "stderr": 1,
                                                 "stream": 1})
            api.start(cid)
        except Exception:
            api.remove_container(cid, force=True)
            raise
        sock = getattr(raw, "_sock", raw)
        return cid, sock

    async def _new_container(self) -> DockerZygote:
        cid, sock = await asyncio.to_thread(self._create)
        zyg = DockerZygote(f"container {cid[:12]}", cid, sock)
        self._live[cid] = zyg
        zyg._send(ZygoteRequests.init(self._init_opts, self._seccomp))
        try:
            await zyg.wait_ready(60.0)
        except ZygoteDied:
            self._discard(zyg)
            raise
        return zyg

    def _refill(self) -> None:
        """Start one more warm container unless the pool is (about to be) full."""
        if self._pool is None or self._closed or \
                self._pool.qsize() + self._filling >= self.config.docker_pool_size:
            return
        self._filling += 1

        async def one() -> None:
            try:
                zyg = await self._new_container()
            except Exception:
                return  # the next run creates one itself and reports the failure
            finally:
                self._filling -= 1
            if self._closed or self._pool is None:
                self._discard(zyg)
            else:
                self._pool.put_nowait(zyg)

        task = asyncio.get_running_loop().create_task(one())
        self._refills.add(task)
        task.add_done_callback(self._refills.discard)

    async def _take(self) -> DockerZygote:
        assert self._pool is not None
        while not self._pool.empty():
            zyg = self._pool.get_nowait()
            if not zyg.closed:
                return zyg
            self._discard(zyg)
        return await self._new_container()

    def _discard(self, zyg: DockerZygote) -> None:
        """Close and remove a container in the background."""
        self._live.pop(zyg.container_id, None)
        zyg.fail("container discarded")

        def remove() -> None:
            try:
                self._client.api.remove_container(zyg.container_id, force=True)
            except Exception:
                pass  # auto_remove already took it

        task = asyncio.get_running_loop().create_task(asyncio.to_thread(remove))
        self._refills.add(task)  # type: ignore[arg-type]
        task.add_done_callback(self._refills.discard)  # type: ignore[arg-type]

    async def _close(self) -> None:
        for task in list(self._refills):
            try:
                await task
            except Exception:
                pass
        if self._pool is not None:
            while not self._pool.empty():
                self._discard(self._pool.get_nowait())
        for zyg in list(self._live.values()):
            self._discard(zyg)
        for task in list(self._refills):
            try:
                await task
            except Exception:
                pass
        if self._client is not None:
            await asyncio.to_thread(self._client.close)

    # -- runs
    async def _execute(self, spec: RunSpec, handle: _DockerSession | None) -> ExecResult:
        if handle is None:
            zyg = await self._take()
            workdir, create = f"{WORKSPACE}/run", True
        else:
            zyg, workdir, create = await self._session_zygote(handle), WORKSPACE, False
        header, blobs = self._requests.run(spec, workdir=workdir, uid=None, create_workdir=create)
        try:
            reply, out = await zyg.request(header, blobs, timeout=spec.timeout + HOST_GRACE_S)
            return result_from_frame(reply, out)
        except ZygoteDied as exc:
            return await self._died(zyg, exc)
        finally:
            if handle is None:
                self._discard(zyg)
                self._refill()

    async def _died(self, zyg: DockerZygote, exc: Exception) -> ExecResult:
        """A container that died mid-run: an OOM kill is a result, anything else an error."""
        def oom_killed() -> bool:
            try:
                info = self._client.api.inspect_container(zyg.container_id)
                return bool(info.get("State", {}).get("OOMKilled"))
            except Exception:
                return False

        if await asyncio.to_thread(oom_killed):
            return ExecResult(stdout="", stderr="killed: container memory limit exceeded\n",
                              exit_code=137, oom_killed=True)
        return ExecResult.failure(str(exc))

    # -- sessions
    async def _open_session(self, persistent_python: bool) -> _DockerSession:
        return _DockerSession(await self._take(), persistent_python)

    async def _session_zygote(self, handle: _DockerSession) -> DockerZygote:
        if handle.zyg.closed:  # the container died: a fresh one (files are lost with it)
            handle.zyg = await self._take()
            handle.had_kernel = handle.had_kernel or handle.persistent
        return handle.zyg

    async def _close_session(self, handle: _DockerSession) -> None:
        self._discard(handle.zyg)
        self._refill()

    async def _run_cell(self, handle: _DockerSession, spec: RunSpec) -> ExecResult:
        zyg = await self._session_zygote(handle)
        header, blobs = self._requests.cell(spec, session=handle.sid, had_kernel=handle.had_kernel,
                                            workdir=WORKSPACE, uid=None)
        handle.had_kernel = True
        try:
            reply, out = await zyg.request(header, blobs, timeout=spec.timeout + HOST_GRACE_S)
        except ZygoteDied as exc:
            return await self._died(zyg, exc)
        return result_from_frame(reply, out)

    async def _read_file(self, handle: _DockerSession, path: str) -> bytes:
        zyg = await self._session_zygote(handle)
        reply, blobs = await zyg.request(self._requests.read_file(WORKSPACE, path), timeout=60)
        file_reply(reply, "read", path)
        return blobs[0]

    async def _write_file(self, handle: _DockerSession, path: str, data: bytes) -> None:
        zyg = await self._session_zygote(handle)
        reply, _ = await zyg.request(self._requests.write_file(WORKSPACE, path, None), [data],
                                     timeout=60)
        file_reply(reply, "write", path)

    def _session_workdir(self, handle: _DockerSession) -> str:
        return WORKSPACE

    async def _fork_session(self, handle: _DockerSession) -> Any:
        raise SandboxError(
            "the docker sandbox cannot fork sessions: a session is one container, and a fork "
            "inside it would share the container's memory, pids and CPU limits and its one "
            "/workspace; use Sandbox(backend='local') for session.fork()")

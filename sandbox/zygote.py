"""Host side of the in-sandbox runtime (``inner``): an asyncio client for one zygote.

``ZygoteClient`` multiplexes requests over one byte stream (request ids, one future each) and
turns a dead or silent zygote into ``ZygoteDied`` for every waiter, so callers can convert it
into an error ``ExecResult``. ``LocalZygote`` starts the runtime under the chosen launcher
(bubblewrap/unshare/none) over a socketpair; the Docker backend subclasses the client for a
container's attach socket.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from typing import Any

from palaestra.errors import SandboxError
from palaestra.sandbox.inner.framing import FrameReader, pack
from palaestra.sandbox.requests import ZygoteRequests
from palaestra.sandbox.shipping import runtime_argv

Frame = tuple[dict[str, Any], list[bytes]]


class ZygoteDied(SandboxError):
    """The sandbox worker exited or stopped answering; the sandbox restarts it on next use."""


class ZygoteClient:
    """Request/response multiplexing over a byte transport (subclasses provide the transport)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.features: dict[str, Any] = {}
        self.load = 0
        self.closed = False
        self.close_reason = ""
        self._reader = FrameReader(1 << 31)
        self._pending: dict[int, asyncio.Future[Frame]] = {}
        self._ready: asyncio.Future[Frame] | None = None
        self._ids = itertools.count(1)
        self._wbuf = bytearray()
        self.log_tail: collections.deque[str] = collections.deque(maxlen=40)

    # -- transport hooks
    def _write_some(self, data: bytes | bytearray) -> int:
        raise NotImplementedError

    def _want_write(self, on: bool) -> None:
        raise NotImplementedError

    def _close_transport(self) -> None:
        raise NotImplementedError

    # -- incoming
    def feed(self, data: bytes) -> None:
        """Bytes from the agent; resolves the matching futures."""
        try:
            frames = self._reader.feed(data)
        except (ValueError, UnicodeDecodeError) as exc:
            self.fail(f"garbled frame from the sandbox worker: {exc}")
            return
        for header, blobs in frames:
            op = header.get("op")
            if op == "ready":
                if self._ready is not None and not self._ready.done():
                    self._ready.set_result((header, blobs))
                continue
            fut = self._pending.pop(header.get("id"), None)  # type: ignore[arg-type]
            if fut is not None and not fut.done():
                fut.set_result((header, blobs))

    def fail(self, reason: str) -> None:
        """The transport is gone: every waiter gets ZygoteDied."""
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        tail = " | ".join(list(self.log_tail)[-5:])
        err = ZygoteDied(f"{reason}{' (worker log: ' + tail + ')' if tail else ''}")
        for fut in list(self._pending.values()) + [self._ready]:
            if fut is not None and not fut.done():
                fut.set_exception(err)
                fut.exception()  # mark retrieved: a waiter may have been cancelled already
        self._pending.clear()
        try:
            self._close_transport()
        except OSError:
            pass

    # -- outgoing
    def _send(self, data: bytes) -> None:
        if self.closed:
            raise ZygoteDied(self.close_reason or "sandbox worker is closed")
        if self._wbuf:
            self._wbuf += data
            return
        try:
            n = self._write_some(data)
        except BlockingIOError:
            n = 0
        except OSError as exc:
            self.fail(f"cannot write to the sandbox worker: {exc}")
            raise ZygoteDied(self.close_reason) from exc
        if n < len(data):
            self._wbuf += data[n:]
            self._want_write(True)

    def on_writable(self) -> None:
        try:
            n = self._write_some(self._wbuf)
        except BlockingIOError:
            return
        except OSError as exc:
            self.fail(f"cannot write to the sandbox worker: {exc}")
            return
        del self._wbuf[:n]
        if not self._wbuf:
            self._want_write(False)

    def send_nowait(self, header: dict[str, Any], blobs: Sequence[bytes] = ()) -> None:
        """Fire-and-forget (e.g. ``cancel``)."""
        self._send(pack(header, blobs))

    async def request(self, header: dict[str, Any], blobs: Sequence[bytes] = (),
                      timeout: float | None = None) -> Frame:
        """Send one request and wait for its reply frame."""
        rid = next(self._ids)
        fut: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        self.load += 1
        try:
            self._send(pack(dict(header, id=rid), blobs))
            try:
                return await asyncio.wait_for(fut, timeout)
            except asyncio.CancelledError:
                if not self.closed and header.get("op") in ("run", "cell"):
                    self.send_nowait({"op": "cancel", "id": rid})
                raise
            except asyncio.TimeoutError:
                self.fail(f"sandbox worker did not answer within {timeout:.1f}s")
                raise ZygoteDied(self.close_reason) from None
        finally:
            self._pending.pop(rid, None)
            self.load -= 1

    async def wait_ready(self, timeout: float) -> dict[str, Any]:
        assert self._ready is not None
        try:
            header, _ = await asyncio.wait_for(self._ready, timeout)
        except asyncio.TimeoutError:
            self.fail(f"sandbox worker did not start within {timeout:.0f}s")
            raise ZygoteDied(self.close_reason) from None
        self.features = header.get("features", {})
        return self.features


class LocalZygote(ZygoteClient):
    """The agent started as a local process under a launcher prefix, over a socketpair.

    A plain ``subprocess.Popen`` (not an asyncio subprocess): the worker is not tied to the event
    loop that started it, so a sandbox can move to another loop (see ``Sandbox.start``).
    Its stderr goes to an unlinked temporary file whose tail is quoted when it dies.
    """

    def __init__(self, name: str, launcher: Sequence[str], python: str, sys_path: Sequence[str],
                 preload: Sequence[str], env: dict[str, str]) -> None:
        super().__init__(name)
        self._launcher = list(launcher)
        self._python = python
        self._sys_path = list(sys_path)
        self._preload = list(preload)
        self._env = env
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, init_opts: dict[str, Any], seccomp_bpf: bytes,
                    timeout: float = 60.0) -> dict[str, Any]:
        loop = self._loop = asyncio.get_running_loop()
        parent, child = socket.socketpair()
        opts = {"fd": child.fileno(), "preload": self._preload, "sys_path": self._sys_path}
        argv = [*self._launcher, *runtime_argv(self._python, opts)]
        self._log = tempfile.TemporaryFile(prefix="palaestra-zygote-")
        try:
            self._proc = subprocess.Popen(
                argv, pass_fds=[child.fileno()], env=self._env, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=self._log, start_new_session=True)
        except OSError as exc:
            parent.close()
            raise ZygoteDied(f"cannot start the sandbox worker ({argv[0]}): {exc}") from exc
        finally:
            child.close()
        parent.setblocking(False)
        self._sock = parent
        self._ready = loop.create_future()
        loop.add_reader(parent.fileno(), self._on_readable)
        self._send(ZygoteRequests.init(init_opts, seccomp_bpf))
        return await self.wait_ready(timeout)

    def fail(self, reason: str) -> None:
        if not self.closed and self._log is not None:
            try:
                self._log.seek(max(0, self._log.seek(0, 2) - 2000))
                for line in self._log.read().decode("utf-8", "replace").splitlines():
                    self.log_tail.append(line)
            except (OSError, ValueError):
                pass
        super().fail(reason)

    def _on_readable(self) -> None:
        assert self._sock is not None
        try:
            data = self._sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.fail(f"sandbox worker connection failed: {exc}")
            return
        if not data:
            code = self._proc.poll() if self._proc is not None else None
            self.fail("sandbox worker exited" + (f" with status {code}" if code is not None
                                                 else " (connection closed)"))
            return
        self.feed(data)

    def _write_some(self, data: bytes | bytearray) -> int:
        assert self._sock is not None
        return self._sock.send(data)

    def _want_write(self, on: bool) -> None:
        assert self._loop is not None and self._sock is not None
        if on:
            self._loop.add_writer(self._sock.fileno(), self.on_writable)
        else:
            self._loop.remove_writer(self._sock.fileno())

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, 9)
            except OSError:
                pass

    def _close_transport(self) -> None:
        if self._sock is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._sock.fileno())
                self._loop.remove_writer(self._sock.fileno())
            self._sock.close()
        self._kill()

    def abandon(self) -> None:
        """Kill the worker without touching its event loop (that loop may be closed)."""
        self.closed = True
        self.close_reason = "abandoned (event loop changed)"
        self._pending.clear()
        if self._sock is not None:
            self._sock.close()
        self._kill()
        if self._log is not None:
            self._log.close()

    async def aclose(self) -> None:
        """Stop the worker and everything it started."""
        if not self.closed:
            try:
                self.send_nowait({"op": "shutdown"})
            except ZygoteDied:
                pass
        proc = self._proc
        if proc is not None:
            try:
                await asyncio.to_thread(proc.wait, 2.0)
            except subprocess.TimeoutExpired:
                pass
        self.fail("sandbox closed")
        if proc is not None:
            try:
                await asyncio.to_thread(proc.wait, 5.0)
            except subprocess.TimeoutExpired:
                pass
        if self._log is not None:
            self._log.close()

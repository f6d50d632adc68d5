"""The ``Sandbox`` interface: one async API over every backend, plus stateful sessions (the
validated request every backend receives is `palaestra.sandbox.spec.RunSpec`).

``Sandbox(...)`` is also the factory (``backend="local"`` by default, or ``"docker"``)::

    async with Sandbox(memory_mb=256) as sb:
        result = await sb.run("print(1 + 1)", language="python", timeout=5.0,
                              stdin=None, files={"data.txt": b"42"})
        async with sb.session(persistent_python=True) as s:   # working dir (and vars) persist
            await s.run("x = 41")
            await s.run("print(x + 1)")
            await s.write_file("in.txt", b"hello")
            await s.run_command(["cat", "in.txt"])

Stateless ``run``/``run_command`` get a fresh working directory each time. A failing program and
a failing sandbox both come back as an ``ExecResult`` (the latter with ``error`` set); only bad
arguments (a caller bug) raise, as ``SandboxError``/``ConfigError`` saying what to fix.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from palaestra.errors import ConfigError, SandboxError
from palaestra.sandbox.config import SandboxConfig
from palaestra.sandbox.limiter import ExecLimiter
from palaestra.sandbox.result import ExecResult
from palaestra.sandbox.spec import (
    FileMap,
    RunSpec,
    as_bytes,
    check_relative_path,
    make_spec,
    spec_for_language,
)

#: backend name -> its class: each backend registers itself by subclassing `Sandbox` with its
#: ``backend_name`` (`palaestra.sandbox` imports both backends, so ``Sandbox(backend=...)`` finds
#: them without this module importing its own subclasses)
_BACKENDS: dict[str, type[Sandbox]] = {}


def _backend_class(backend: str) -> type[Sandbox]:
    cls = _BACKENDS.get(backend)
    if cls is None:
        raise ConfigError(f"unknown sandbox backend {backend!r}; choose 'local' or 'docker'")
    return cls


class Sandbox(abc.ABC):
    """Async sandbox for untrusted code. ``Sandbox(...)`` builds the ``backend`` asked for."""

    backend_name = "abstract"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.backend_name != "abstract":  # the first class of a name is the backend
            _BACKENDS.setdefault(cls.backend_name, cls)

    def __new__(cls, *args: Any, backend: str | None = None, **kwargs: Any) -> Sandbox:
        if cls is Sandbox:
            cls = _backend_class(backend or "local")
        return super().__new__(cls)

    def __init__(self, config: SandboxConfig | None = None, *, limiter: ExecLimiter | None = None,
                 backend: str | None = None, **options: Any) -> None:
        if backend is not None and backend != self.backend_name:
            raise ConfigError(f"{type(self).__name__} is the {self.backend_name!r} backend, "
                              f"not {backend!r}; use Sandbox(backend={backend!r})")
        self.config = SandboxConfig.from_kwargs(config, **options)
        self._limiter = limiter
        self._owns_limiter = limiter is None
        self._start_lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self._closed = False
        self._default_session: SandboxSession | None = None

    @property
    def limiter(self) -> ExecLimiter:
        """The limiter every run of this sandbox goes through (shared if one was passed)."""
        if self._limiter is None:
            self._limiter = ExecLimiter(self.config.max_concurrency, self.config.rate_limit_per_s)
        return self._limiter

    # -- lifecycle
    async def __aenter__(self) -> Sandbox:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def start(self) -> None:
        """Start workers (idempotent). Raises SandboxError if the sandbox cannot be made safe."""
        if self._closed:
            raise SandboxError("this sandbox was closed; create a new one")
        loop = asyncio.get_running_loop()
        if self._loop is not None and self._loop is not loop:
            # Used from another event loop (e.g. one asyncio.run per sync env step): the workers'
            # connections belong to the old loop, so they are replaced.
            self._loop = loop
            self._start_lock = None
            if self._owns_limiter:
                self._limiter = None
            if self._started:
                await self._rebind()
        self._loop = loop
        if self._started:
            return
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._started:
                return
            await self._start()
            self._started = True
            if self.config.stateful:
                self._default_session = await SandboxSession(
                    self, self.config.persistent_python).open()

    async def close(self) -> None:
        """Stop everything this sandbox started and delete its working directories."""
        if self._closed:
            return
        self._closed = True
        if self._default_session is not None:
            await self._default_session.close()
        if self._started:
            await self._close()

    # -- public API
    async def run(self, code: str, language: str = "python", timeout: float = 5.0,
                  stdin: bytes | str | None = None, files: FileMap | None = None) -> ExecResult:
        """Run a program (``language``: python, bash, sh) in a fresh working directory."""
        if self._default_session is not None or self.config.stateful:
            await self.start()
            assert self._default_session is not None
            return await self._default_session.run(code, language, timeout, stdin, files)
        spec = spec_for_language(code, language, timeout, stdin, files)
        return await self._guarded(spec, None)

    async def run_fresh(self, code: str, language: str = "python", timeout: float = 5.0,
                        stdin: bytes | str | None = None,
                        files: FileMap | None = None) -> ExecResult:
        """Like ``run``, in a fresh working directory even on a stateful sandbox: nothing a
        session wrote is visible (for graders, see ``palaestra.sandbox.integrity``)."""
        spec = spec_for_language(code, language, timeout, stdin, files)
        return await self._guarded(spec, None)

    async def run_command(self, argv: Sequence[str], timeout: float = 5.0,
                          stdin: bytes | str | None = None,
                          files: FileMap | None = None) -> ExecResult:
        """Run ``argv`` (searched on the sandbox PATH) in a fresh working directory."""
        if self._default_session is not None or self.config.stateful:
            await self.start()
            assert self._default_session is not None
            return await self._default_session.run_command(argv, timeout, stdin, files)
        spec = make_spec("exec", "", argv, timeout, stdin, files)
        return await self._guarded(spec, None)

    async def read_file(self, path: str) -> bytes:
        """Read a file of the stateful workspace (``Sandbox(stateful=True)``)."""
        return await self._stateful("read_file").read_file(path)

    async def write_file(self, path: str, data: bytes | str) -> None:
        """Write a file into the stateful workspace (``Sandbox(stateful=True)``)."""
        await self._stateful("write_file").write_file(path, data)

    def session(self, persistent_python: bool = False) -> SandboxSession:
        """A stateful session: its working directory persists across calls until closed;
        with ``persistent_python`` python code shares one interpreter (variables persist)."""
        return SandboxSession(self, persistent_python)

    def _stateful(self, what: str) -> SandboxSession:
        if self._default_session is None:
            raise SandboxError(f"{what} needs a stateful sandbox: use Sandbox(stateful=True) "
                               "(and enter it) or `async with sandbox.session() as s`")
        return self._default_session

    async def _guarded(self, spec: RunSpec, handle: Any) -> ExecResult:
        """Run through the limiter; any sandbox failure becomes an error ExecResult."""
        try:
            await self.start()
        except SandboxError:
            if not self._started:
                raise  # never started: a setup problem the caller must fix
        async with self.limiter:
            try:
                return await self._execute(spec, handle)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bad rollout is data, not a crash
                return ExecResult.failure(f"{type(exc).__name__}: {exc}")

    # -- backend hooks
    @abc.abstractmethod
    async def _start(self) -> None: ...

    async def _rebind(self) -> None:  # noqa: B027 (optional hook)
        """Drop workers bound to a previous event loop; new ones start on the current loop."""

    @abc.abstractmethod
    async def _close(self) -> None: ...

    @abc.abstractmethod
    async def _execute(self, spec: RunSpec, handle: Any) -> ExecResult: ...

    @abc.abstractmethod
    async def _open_session(self, persistent_python: bool) -> Any: ...

    @abc.abstractmethod
    async def _close_session(self, handle: Any) -> None: ...

    @abc.abstractmethod
    async def _run_cell(self, handle: Any, spec: RunSpec) -> ExecResult: ...

    @abc.abstractmethod
    async def _read_file(self, handle: Any, path: str) -> bytes: ...

    @abc.abstractmethod
    async def _write_file(self, handle: Any, path: str, data: bytes) -> None: ...

    @abc.abstractmethod
    def _session_workdir(self, handle: Any) -> str: ...

    async def _fork_session(self, handle: Any) -> Any:
        """A copy-on-write fork of a persistent session (backends that can, override)."""
        raise SandboxError(f"the {self.backend_name!r} sandbox cannot fork sessions; use "
                           "Sandbox(backend='local')")


class SandboxSession:
    """A working directory (and optionally a python interpreter) that persists across calls.

    Calls are serialised; nothing a call starts outlives it (except the persistent interpreter).
    If the interpreter dies (timeout, crash, memory) the next call starts a fresh one and says
    so in stderr; files in the working directory are kept.
    """

    def __init__(self, sandbox: Sandbox, persistent_python: bool = False) -> None:
        self.sandbox = sandbox
        self.persistent_python = persistent_python
        self._handle: Any = None
        self._lock = asyncio.Lock()
        self._closed = False

    @property
    def workdir(self) -> str:
        """The session's working directory as the sandboxed program sees it."""
        self._need_open()
        return self.sandbox._session_workdir(self._handle)

    async def open(self) -> SandboxSession:
        if self._closed:  # never re-open: a closed session's calls fail (and leak nothing)
            self._need_open()
        if self._handle is None:
            await self.sandbox.start()
            self._handle = await self.sandbox._open_session(self.persistent_python)
        return self

    async def __aenter__(self) -> SandboxSession:
        return await self.open()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    def _need_open(self) -> None:
        if self._closed:
            raise SandboxError("this session is closed; open a new one with sandbox.session()")
        if self._handle is None:
            raise SandboxError("session not open: use `async with sandbox.session() as s`")

    async def run(self, code: str, language: str = "python", timeout: float = 5.0,
                  stdin: bytes | str | None = None, files: FileMap | None = None) -> ExecResult:
        """Run code in the session's directory (python in the persistent interpreter if any)."""
        spec = spec_for_language(code, language, timeout, stdin, files)
        await self.open()
        self._need_open()
        async with self._lock:
            if spec.kind == "python" and self.persistent_python:
                for name, data in spec.files:
                    await self.sandbox._write_file(self._handle, name, data)
                return await self._call(self.sandbox._run_cell, self._handle, spec)
            return await self.sandbox._guarded(spec, self._handle)

    async def run_command(self, argv: Sequence[str], timeout: float = 5.0,
                          stdin: bytes | str | None = None,
                          files: FileMap | None = None) -> ExecResult:
        """Run ``argv`` in the session's working directory."""
        spec = make_spec("exec", "", argv, timeout, stdin, files)
        await self.open()
        self._need_open()
        async with self._lock:
            return await self.sandbox._guarded(spec, self._handle)

    async def _call(self, fn: Any, handle: Any, spec: RunSpec) -> ExecResult:
        async with self.sandbox.limiter:
            try:
                return await fn(handle, spec)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                return ExecResult.failure(f"{type(exc).__name__}: {exc}")

    async def read_file(self, path: str) -> bytes:
        """Bytes of a regular file in the workspace (symlinks are never followed)."""
        rel = check_relative_path(path)
        await self.open()
        self._need_open()
        async with self._lock:
            return await self.sandbox._read_file(self._handle, rel)

    async def write_file(self, path: str, data: bytes | str) -> None:
        """Create or replace a file in the workspace (parent directories are created)."""
        rel = check_relative_path(path)
        raw = as_bytes(data, "data")
        await self.open()
        self._need_open()
        async with self._lock:
            await self.sandbox._write_file(self._handle, rel, raw)

    async def fork(self) -> SandboxSession:
        """A copy-on-write fork of this persistent-python session: the interpreter forks
        itself, so variables, open files and the working directory carry over; the fork has
        its own workspace (a copy of this one's), rlimits and Landlock domain, and neither can
        see nor signal the other. Close it like any session. Local backend only; needs a
        pid namespace per run, per-run uids (root) and Landlock ABI 6 (Linux 6.12), and says
        so if one is missing. What the two share: see ``palaestra.sandbox.inner.kernel``."""
        if not self.persistent_python:
            raise SandboxError("fork needs a persistent_python session: "
                               "sandbox.session(persistent_python=True)")
        await self.open()
        self._need_open()
        async with self._lock:
            handle = await self.sandbox._fork_session(self._handle)
        child = SandboxSession(self.sandbox, persistent_python=True)
        child._handle = handle
        return child

    async def close(self) -> None:
        """Kill the session's processes and delete its working directory."""
        if self._closed:
            return
        self._closed = True
        if self._handle is not None:
            handle, self._handle = self._handle, None
            await self.sandbox._close_session(handle)

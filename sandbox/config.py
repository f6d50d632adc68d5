"""``SandboxConfig``: every knob of a sandbox, validated at once.

Plain frozen dataclass (importing it costs nothing). Backends read the fields they know;
``SandboxConfig.from_kwargs`` lets ``Sandbox(memory_mb=256, ...)`` take the same names as
keyword arguments. All problems are reported together in one ``ConfigError``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from palaestra.errors import ConfigError

#: Modules the warm workers import before forking, so user code gets them for free. Chosen for
#: what model-written code imports most; each preloaded module also makes every fork a little
#: dearer (dataclasses, statistics, decimal, datetime would add ~3 MB and ~40 mappings).
DEFAULT_PRELOAD: tuple[str, ...] = (
    "atexit", "bisect", "collections", "copy", "functools", "heapq", "itertools", "json", "math",
    "operator", "random", "re", "string", "types", "typing",
)

#: Default Docker image built by scripts/build_sandbox_image.sh (no registry needed).
DEFAULT_IMAGE = "palaestra-sandbox:py3"


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and isolation settings shared by all backends."""

    memory_mb: int = 512
    """Address-space cap per run (local) or container memory limit (docker), in MiB."""
    cpu_seconds: float | None = None
    """CPU-time cap per run; None means the run's timeout + 1 s."""
    max_processes: int = 64
    """Processes/threads one run may have at once (RLIMIT_NPROC per run uid; docker pids)."""
    max_file_size_mb: int = 64
    """Largest file a run may write (RLIMIT_FSIZE); also bounds captured stdout/stderr."""
    max_open_files: int = 256
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    max_output_bytes: int = 128 * 1024
    """Bytes of stdout and of stderr kept per run; the rest is cut with a marker."""
    max_read_bytes: int = 16 * 1024 * 1024
    """Largest file ``read_file`` returns."""
    max_concurrency: int = 8
    """Runs in flight at once in this sandbox (unless a shared ``limiter`` is given)."""
    rate_limit_per_s: float | None = None
    """Run starts per second (token bucket), None for no rate limit."""
    stateful: bool = False
    """Make the sandbox itself one session: the working directory persists across calls."""
    persistent_python: bool = False
    """With ``stateful``: python runs share one interpreter, so variables persist."""
    session_cpu_seconds: float = 600.0
    """CPU-time cap of a persistent interpreter over its whole life."""
    allow_network_isolation_fallback: bool = False
    """Run even where no network namespace can be made (seccomp + Landlock still block
    sockets in the child); without it the sandbox refuses to start (fail closed)."""
    use_bwrap: bool | None = None
    """Use bubblewrap (None: when it works here)."""
    per_run_uid: bool | None = None
    """Give each run its own unprivileged uid (None: when running as root, which it needs)."""
    per_run_pid_namespace: bool | None = None
    """Give each run its own pid namespace, /proc and workspace tmpfs (None or True: always,
    and the sandbox refuses to start where it cannot; False accepts weaker isolation)."""
    workers: int | None = None
    """Warm zygote processes (local backend), each forking children for its share of runs;
    None: one per CPU, at most 2 (forks are serial within one zygote)."""
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    """Modules imported once in the warm workers (add e.g. "numpy" to make it instant)."""
    python: str | None = None
    """Interpreter for the local backend (default: the current one)."""
    python_site: bool = True
    """Let sandboxed python import installed packages (site-packages)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment variables for every run (the host environment is never passed)."""
    ro_paths: tuple[str, ...] = ()
    """Extra host paths visible read-only inside the local sandbox."""
    workdir_root: str | None = None
    """Where per-run working directories are created (default: a fresh temp directory)."""
    image: str = DEFAULT_IMAGE
    """Docker image (built locally by scripts/build_sandbox_image.sh)."""
    docker_pool_size: int = 2
    """Pre-started containers kept warm for stateless runs."""
    docker_cpus: float = 1.0
    """CPU share of one container (docker ``nano_cpus``)."""
    docker_user: str = "65534:65534"
    """Non-root user the container runs as."""
    workspace_mb: int = 512
    """Size limit of each run's and each session's own workspace tmpfs (local), so one cannot
    fill another's; of each container's workspace (docker)."""
    docker_url: str | None = None
    """Docker engine URL (default: from the environment, i.e. the local socket)."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        positive = ("memory_mb", "max_processes", "max_file_size_mb", "max_open_files",
                    "max_output_bytes", "max_read_bytes", "max_concurrency",
                    "docker_pool_size", "workspace_mb")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if self.workers is not None and (not isinstance(self.workers, int) or self.workers < 1):
            problems.append(f"workers must be a positive integer or None, got {self.workers!r}")
        for name in ("cpu_seconds", "rate_limit_per_s"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                problems.append(f"{name} must be a positive number or None, got {value!r}")
        if self.memory_mb < 64:
            problems.append(f"memory_mb={self.memory_mb} is too small for python; use >= 64")
        if self.max_processes < 4:
            problems.append("max_processes must be >= 4 (python itself needs a few threads)")
        if self.persistent_python and not self.stateful:
            problems.append("persistent_python=True needs stateful=True "
                            "(or use sandbox.session(persistent_python=True))")
        if not (isinstance(self.docker_cpus, (int, float)) and self.docker_cpus > 0):
            problems.append(f"docker_cpus must be > 0, got {self.docker_cpus!r}")
        if isinstance(self.preload, str):
            problems.append("preload must be a tuple of module names, not a string")
        if problems:
            raise ConfigError("invalid sandbox config:\n  - " + "\n  - ".join(problems))

    @classmethod
    def from_kwargs(cls, config: SandboxConfig | None = None, **kwargs: Any) -> SandboxConfig:
        """``config`` with ``kwargs`` applied; unknown names raise one ConfigError listing them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown sandbox option(s) {unknown}; valid options: "
                              f"{', '.join(sorted(known))}")
        if "preload" in kwargs and kwargs["preload"] is not None:
            kwargs["preload"] = tuple(kwargs["preload"])
        if "ro_paths" in kwargs and kwargs["ro_paths"] is not None:
            kwargs["ro_paths"] = tuple(kwargs["ro_paths"])
        base = config or cls()
        return dataclasses.replace(base, **kwargs) if kwargs else base

    def cpu_limit(self, timeout: float) -> int:
        """Whole CPU seconds for a run with this wall timeout."""
        if self.cpu_seconds is not None:
            return max(1, int(self.cpu_seconds + 0.999))
        return max(1, int(timeout + 0.999) + 1)

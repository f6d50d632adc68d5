"""How the local sandbox is walled off: the launcher command and the paths a run may see.

Three launchers, strongest first: bubblewrap (new mount, network, pid, ipc and uts namespaces;
only system directories, a curated /etc and the interpreter visible, read-only), ``unshare``
(new network/pid/ipc/uts/mount namespaces; the filesystem is then confined by Landlock alone),
or none (only with ``allow_network_isolation_fallback``: seccomp and Landlock in the child still
block sockets). Landlock rules inside every child use the same read-only list. Under every
launcher the zygote makes each run's pid and mount namespaces itself (``palaestra.sandbox.inner``).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: System directories visible read-only (symlinked ones are recreated as symlinks under bwrap).
SYSTEM_DIRS: tuple[str, ...] = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
#: The parts of /etc programs need; nothing else of /etc (no keys, no shadow) is visible.
ETC_PATHS: tuple[str, ...] = (
    "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives",
    "/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/etc/hosts", "/etc/host.conf",
    "/etc/localtime", "/etc/timezone", "/etc/os-release", "/etc/debian_version", "/etc/services",
    "/etc/protocols", "/etc/mime.types", "/etc/ssl/certs", "/etc/ca-certificates",
    "/etc/python3", "/etc/python3.11", "/etc/bash.bashrc", "/etc/profile", "/etc/inputrc",
    "/etc/magic", "/etc/locale.alias", "/etc/fonts", "/etc/matplotlibrc",
)
#: Device files a run may read and write.
DEV_FILES: tuple[str, ...] = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random",
                              "/dev/urandom", "/dev/tty")
#: Capabilities the zygote keeps under bwrap (as root) to give each run its own uid.
ZYGOTE_CAPS_UID: tuple[str, ...] = ("CAP_SETUID", "CAP_SETGID", "CAP_CHOWN", "CAP_KILL",
                                    "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER")
#: Extra capability for per-run pid and mount namespaces (and the workspace tmpfs mounts).
ZYGOTE_CAPS_PIDNS: tuple[str, ...] = ("CAP_SYS_ADMIN",)


@dataclass(frozen=True)
class PythonLayout:
    """Where an interpreter and its libraries live (all must be visible in the sandbox)."""

    executable: str
    dirs: tuple[str, ...]
    site_dirs: tuple[str, ...] = ()


@functools.lru_cache(maxsize=8)
def python_layout(python: str | None = None) -> PythonLayout:
    """Directories of ``python`` (default: this interpreter): prefixes and site-packages.

    Paths added by ``.pth`` files (e.g. an editable checkout) are deliberately not included:
    the sandbox sees installed packages, never the source repository.
    """
    if python is None or os.path.realpath(python) == os.path.realpath(sys.executable):
        import site

        info: dict[str, Any] = {"exe": sys.executable, "dirs": [
            sys.base_prefix, sys.prefix, sys.exec_prefix, *site.getsitepackages()]}
    else:
        code = ("import json,sys,site;print(json.dumps({'exe':sys.executable,'dirs':"
                "[sys.base_prefix,sys.prefix,sys.exec_prefix,*site.getsitepackages()]}))")
        out = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True,
                             timeout=30, check=True).stdout
        info = json.loads(out)
    dirs: list[str] = []
    for d in [os.path.dirname(os.path.realpath(info["exe"])), *info["dirs"]]:
        real = os.path.realpath(d)
        if os.path.isdir(real) and not _covered(real, SYSTEM_DIRS) and not _covered(real, dirs):
            dirs = [x for x in dirs if not _covered(x, [real])] + [real]
    site_dirs = tuple(d for d in info["dirs"][3:] if os.path.isdir(d))
    return PythonLayout(executable=info["exe"], dirs=tuple(dirs), site_dirs=site_dirs)


def _covered(path: str, roots: Sequence[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def landlock_paths(layout: PythonLayout, extra: Sequence[str] = ()) -> list[str]:
    """Read-only paths for the Landlock ruleset of each child."""
    paths = [d for d in SYSTEM_DIRS if os.path.exists(d)]
    paths += [p for p in ETC_PATHS if os.path.exists(p)]
    paths += list(layout.dirs) + [p for p in extra if os.path.exists(p)] + ["/proc", "/dev"]
    exe_dir = os.path.dirname(layout.executable)
    if os.path.isdir(exe_dir) and not _covered(exe_dir, paths):
        paths.append(exe_dir)
    return paths


def bwrap_argv(bwrap: str, layout: PythonLayout, root_dir: str, extra_ro: Sequence[str] = (),
               caps: Sequence[str] = (), workspace_mb: int = 512, chdir: str = "/") -> list[str]:
    """The bubblewrap prefix that starts the zygote in fresh namespaces.

    ``root_dir`` (where working directories live) is a private tmpfs of ``workspace_mb`` MiB:
    creating and deleting a run's directory costs microseconds, and nothing lands on the
    host's disk.
    """
    argv = [bwrap, "--die-with-parent", "--new-session", "--unshare-net", "--unshare-pid",
            "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox"]
    visible: list[str] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
            visible.append(d)
    for p in ETC_PATHS:
        argv += ["--ro-bind-try", p, p]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    made: set[str] = {"/", "/tmp", "/etc", "/proc", "/dev"}

    def parents(path: str) -> list[str]:
        out: list[str] = []
        parent = os.path.dirname(path)
        while parent not in made and parent != "/":
            out.append(parent)
            parent = os.path.dirname(parent)
        for p in reversed(out):
            made.add(p)
        return [arg for p in reversed(out) for arg in ("--perms", "0755", "--dir", p)]

    for d in [*layout.dirs, *[os.path.realpath(p) for p in extra_ro if os.path.exists(p)]]:
        if _covered(d, visible):
            continue
        argv += parents(d) + ["--ro-bind", d, d]
        visible.append(d)
        made.add(d)
    argv += parents(root_dir) + ["--perms", "0711", "--size", str(workspace_mb * 2**20),
                                 "--tmpfs", root_dir]
    for cap in caps:
        argv += ["--cap-add", cap]
    return argv + ["--chdir", chdir, "--"]


def unshare_argv(unshare: str, as_root: bool) -> list[str]:
    """The util-linux ``unshare`` prefix (new network, pid, ipc, uts and mount namespaces)."""
    argv = [unshare]
    if not as_root:
        argv += ["--user", "--map-root-user"]
    return argv + ["--net", "--ipc", "--uts", "--pid", "--fork", "--kill-child", "--mount",
                   "--mount-proc", "--"]


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The whole environment of the zygote: nothing inherited from the host."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/nonexistent",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.update(extra or {})
    return env

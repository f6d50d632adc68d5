"""The persistent interpreter of a session (Jupyter-like: globals survive across cells), as it
runs inside its own sandboxed child of the zygote, and how it forks itself for ``session.fork``.

Fork, copy-on-write: the interpreter ``os.fork``s, so variables, open files and the working
directory carry over (open files are re-pointed at the fork's copies). The fork and the
interpreter it came from then each add a Landlock layer of their own (sibling domains): neither
can signal the other (Landlock signal scoping, ABI 6), see it in /proc (hidepid=invisible hides
what ptrace may not reach, and Landlock forbids that across domains), reach its abstract sockets
or touch its workspace (each layer grants one workspace, the fork's being a copy of its
parent's). A double fork re-parents the fork to the namespace's pid 1, which lingers while any
interpreter of the family lives: any one can be killed or closed without the others. Each fork
adds a layer to both sides and Linux stacks at most 16, so a lineage can fork ~14 times. What a
fork shares with its family: the uid (so the RLIMIT_NPROC budget), the pid and mount namespaces,
and the sandbox's root tmpfs (its workspace is a directory there, not a tmpfs of its own).
"""

import builtins
import os
import resource
import signal
import socket
import sys

from .child import RLIMITS, exec_python, setup_child
from .framing import FrameReader, pack
from .linux import PR_SET_CHILD_SUBREAPER, SETUP_FAILED_EXIT, _libc, landlock_restrict
from .payload import blob_spans, read_span, span_memfd
from .procs import _STRAY_EXITS, kill_descendants

#: Landlock layers a process may stack (LANDLOCK_MAX_NUM_LAYERS).
MAX_LANDLOCK_LAYERS = 16


def kernel_child(opts, req, fds, blobs):
    """Body of a persistent interpreter (Jupyter-like): globals survive across cells."""
    try:
        workdir = setup_child(opts, req, fds, keep_fd=req["_sock_fd"])
        sock = socket.socket(fileno=3)
    except BaseException as exc:
        try:
            os.write(2, (f"palaestra sandbox: kernel setup failed: {exc!r}\n").encode())
        finally:
            os._exit(SETUP_FAILED_EXIT)
    try:
        KernelLoop(opts, sock, workdir).serve()
    finally:
        os._exit(1)


def _kill_cell_leftovers(pidns):
    """Nothing a cell started may outlive it (only the kernel itself survives)."""
    if pidns:  # kill(-1) reaches all but pid 1, us and (Landlock scoping) other family members
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
    else:
        kill_descendants(os.getpid())
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    _STRAY_EXITS.clear()


def _lower_limits(limits):
    """The fork's own rlimits, never above what it inherited."""
    for res, key in RLIMITS:
        value = limits.get(key) if key else None
        if value is None:
            continue
        hard = resource.getrlimit(res)[1]
        if hard != resource.RLIM_INFINITY:
            value = min(int(value), hard)
        resource.setrlimit(res, (int(value), int(value)))


def _rebase_fds(old, new):
    """Point every fd open below ``old`` at the same file below ``new`` (same flags and
    offset): a fork's open files are its copies, never its parent's."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not path.startswith(old + "/"):
            continue
        with open(f"/proc/self/fdinfo/{fd}") as fh:
            info = dict(line.split(":", 1) for line in fh if ":" in line)
        flags = int(info["flags"].strip(), 8) & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC)
        copy = os.open(new + path[len(old):], flags)
        try:
            if not flags & os.O_APPEND:
                os.lseek(copy, int(info["pos"].strip()), os.SEEK_SET)
            os.dup2(copy, fd, inheritable=os.get_inheritable(fd))
        finally:
            os.close(copy)


class KernelLoop:
    """Reads cells (and fork requests) from the zygote's socket and runs them in ``__main__``."""

    def __init__(self, opts, sock, workdir):
        import types
        self.opts = opts
        self.sock = sock
        self.workdir = workdir
        self.pidns = bool(opts.get("pidns"))
        self.layers = 1  # Landlock layers on this process (the kernel allows 16)
        self.main = types.ModuleType("__main__")
        self.main.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = self.main
        sys.argv = [""]
        sys.path.insert(0, workdir)
        # Orphans of a cell re-attach here, so one sweep after each cell finds all of them.
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        self.reader = FrameReader(1 << 30)
        self.null = os.open(os.devnull, os.O_RDWR)
        self.fd_queue = []

    def serve(self):
        while True:
            data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 3)
            if not data:
                os._exit(0)
            self.fd_queue.extend(fds)
            for header, _ in self.reader.feed(data):
                if header.get("op") == "fork":
                    (new_fd,), self.fd_queue = self.fd_queue[:1], self.fd_queue[1:]
                    if self.fork(header, new_fd):
                        break  # we are the fork: the rest belonged to our parent's socket
                else:
                    self.cell(header)

    def cell(self, header):
        # The cell's payload memfd (code, then stdin), its stdout and stderr memfds.
        null = self.null
        (payload, out_fd, err_fd), self.fd_queue = self.fd_queue[:3], self.fd_queue[3:]
        spans = blob_spans(header.get("sizes", []))
        code_text = read_span(payload, spans[0]).decode("utf-8", "surrogateescape")
        in_fd = span_memfd(payload, spans[1], "stdin") if header.get("has_stdin") else null
        os.close(payload)
        for target, fd in zip((0, 1, 2), (in_fd, out_fd, err_fd)):
            os.dup2(fd, target)
            if fd != null:
                os.close(fd)
        # Fresh stream objects: an earlier cell may have closed or replaced them (exit()
        # closes sys.stdin, for one).
        sys.stdin = open(0, closefd=False, encoding="utf-8")
        sys.stdout = open(1, "w", closefd=False, encoding="utf-8")
        sys.stderr = open(2, "w", closefd=False, encoding="utf-8", errors="backslashreplace")
        code, oom = exec_python(code_text, self.main.__dict__, filename="<cell>")
        del code_text
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        for target in (0, 1, 2):
            os.dup2(null, target)
        _kill_cell_leftovers(self.pidns)
        self.sock.sendall(pack({"op": "cell_done", "id": header.get("id"),
                                "exit_code": 128 + signal.SIGKILL if oom else code, "oom": oom}))
        if oom:  # its heap may be wrecked: the next cell gets a fresh interpreter
            os.kill(os.getpid(), signal.SIGKILL)

    # -- fork
    def fork(self, header, new_fd):
        """Fork this interpreter; True in the fork (which then serves ``new_fd``)."""
        rid = header.get("id")
        try:
            if self.layers >= MAX_LANDLOCK_LAYERS:
                raise RuntimeError(
                    f"this interpreter was forked or descends from forks {self.layers - 1} "
                    "times: each fork adds a Landlock layer to both sides and Linux allows "
                    f"{MAX_LANDLOCK_LAYERS}; fork from a sibling or open a new session")
            # A double fork with our subreaper flag off: the fork is re-parented at once to the
            # namespace's pid 1, which outlives us, so it is not in our process tree.
            _libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
            try:
                mid = os.fork()
                if mid == 0:
                    if os.fork() == 0:
                        return self._become_fork(header["child"], new_fd)
                    os._exit(0)
                os.waitpid(mid, 0)
            finally:
                _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
            os.close(new_fd)
            landlock_restrict(self.opts["_landlock_nested"], self.workdir,
                              header["parent"]["nursery"])
            self.layers += 1
            self.sock.sendall(pack({"op": "fork_done", "id": rid}))
        except Exception as exc:
            self.sock.sendall(pack({"op": "fork_done", "id": rid,
                                    "error": f"{type(exc).__name__}: {exc}"}))
        return False

    def _become_fork(self, spec, new_fd):
        """In the fork: its own socket, limits, Landlock layer and workspace."""
        try:
            self.sock.detach()  # fd 3, about to be replaced by the fork's own socket
            os.dup2(new_fd, 3, inheritable=False)
            os.close(new_fd)
            self.sock = socket.socket(fileno=3)
            self.reader = FrameReader(1 << 30)
            for fd in self.fd_queue:
                os.close(fd)
            self.fd_queue = []
            _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
            _lower_limits(spec.get("limits") or {})
            old, new = self.workdir, spec["workdir"]
            landlock_restrict(self.opts["_landlock_nested"], new, spec["nursery"])
            self.layers += 1
            _rebase_fds(old, new)
            cwd = os.getcwd()
            rel = os.path.relpath(cwd, old) if cwd == old or cwd.startswith(old + "/") else "."
            try:
                os.chdir(os.path.join(new, rel))
            except OSError:
                os.chdir(new)
            sys.path[:] = [new + p[len(old):] if p == old or p.startswith(old + "/") else p
                           for p in sys.path]
            env = os.environ
            for key in ("HOME", "TMPDIR", "PWD"):
                if env.get(key, "").startswith(old):
                    env[key] = new + env[key][len(old):]
            self.workdir = new
            self.sock.sendall(pack({"op": "hello", "id": spec.get("rid")}))
        except BaseException as exc:
            try:
                os.write(2, f"palaestra sandbox: fork setup failed: {exc!r}\n".encode())
            finally:
                os._exit(SETUP_FAILED_EXIT)
        return True

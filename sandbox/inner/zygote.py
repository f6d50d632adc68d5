"""The zygote: serves the host's requests by forking one fresh, isolated child per run (a spare
forked ahead of demand), hosts persistent kernels, enforces deadlines and reports results.
"""

import os
import selectors
import signal
import time

from .child import run_child, run_status
from .files import read_tree_file, write_tree_file
from .forking import Forker, init_argv
from .jobs import Job
from .linux import (
    PR_SET_CHILD_SUBREAPER,
    _libc,
    unmount,
)
from .payload import PAYLOAD_OPS
from .procs import (
    _STRAY_EXITS,
    _is_zombie,
    children_of,
    kill_descendants,
    real_uid_of,
    reap_strays,
    remove_tree,
)
from .sessions import KernelHost


class Zygote(Forker, KernelHost):
    def __init__(self, chan, opts):
        self.chan = chan
        self.opts = opts
        self.pid = os.getpid()
        self.runs = {}  # leader pid -> Job
        self.kernels = {}  # session -> live Kernel
        self.kernel_pids = {}  # pid -> Kernel (live or retired, until reaped)
        self.forks = {}  # request id -> [answers awaited, parent Kernel, child Kernel]
        self.inits = set()  # spawned pid 1s of runs' namespaces, until reaped
        self.init_argv = init_argv(opts)
        self.sel = selectors.DefaultSelector()
        self.max_output = int(opts.get("max_output", 1 << 17))
        self.null = os.open(os.devnull, os.O_RDWR)
        self.spare = None  # (pid, go socket, out_fd, err_fd, status_fd, exit_fd)
        self.stale_dirs = set()  # session mount points to delete once no namespace holds them
        self.own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC) \
            if opts.get("pidns") else -1

    # -- plumbing
    def send(self, header, blobs=(), fds=()):
        self.chan.send(header, blobs, fds)

    def _memfd(self, name):
        return os.memfd_create(name, os.MFD_CLOEXEC)

    def tracked(self):
        out = set(self.runs) | set(self.kernel_pids) | self.inits
        if self.spare is not None:
            out.add(self.spare[0])
        return out

    def handle(self, header, payload):
        op = header.get("op")
        try:
            if op == "run":
                self.start_run(header, payload)
            elif op == "cell":
                self.start_cell(header, payload)
            elif op == "cancel":
                self.cancel(header["id"])
            elif op == "fork":
                self.fork_kernel(header)  # answered once the kernel and its fork have
            elif op == "kernel_stop":
                self.stop_kernel(header["session"])
                self.send({"op": "ok", "id": header["id"]})
            elif op == "sweep":
                uid = header.get("uid")
                if uid is not None:
                    self.kill_uid(uid)
                ok = kill_descendants(self.pid, keep=self.tracked(), uid=uid)
                self.send({"op": "ok", "id": header["id"], "clean": ok})
            elif op == "mkdir":
                self.make_workdir(header["path"], header.get("uid"), header.get("quota_mb"))
                self.send({"op": "ok", "id": header["id"]})
            elif op == "rmtree":
                path = header["path"]
                if unmount(path):
                    self.drop_spare()  # its copy of our mounts would keep the tmpfs alive
                remove_tree(path)
                if os.path.lexists(path):
                    # still a mount point in a run's namespace (the spare just killed, a run
                    # still exiting): removed once that namespace is gone
                    self.stale_dirs.add(path)
                self.send({"op": "ok", "id": header["id"]})
            elif op == "write_file":
                owner = header.get("owner")
                write_tree_file(header["root"], header["path"], payload,
                                (0, sum(header.get("blobs", []))),
                                owner=tuple(owner) if owner else None)
                self.send({"op": "ok", "id": header["id"]})
            elif op == "read_file":
                fd, size = read_tree_file(header["root"], header["path"], int(header["limit"]))
                try:
                    self.send({"op": "ok", "id": header["id"]}, fds=[(fd, size)])
                finally:
                    os.close(fd)
            elif op == "ping":
                self.send({"op": "ok", "id": header.get("id")})
            elif op == "shutdown":
                self.shutdown()
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as exc:
            self.send({"op": "error", "id": header.get("id"),
                       "error": f"{type(exc).__name__}: {exc}"})

    def start_run(self, req, payload):
        if self._dispatch_to_spare(req, payload) is not None:
            return
        out_fd, err_fd = self._memfd("stdout"), self._memfd("stderr")
        fds = (out_fd, err_fd)
        status_fd = None
        if req.get("kind") == "python":
            status_fd = self._memfd("status")
            fds += (status_fd,)
        oom_before = self.oom_count()
        pid, exit_fd, init = self._fork_run(run_child, (self.opts, req, fds, payload), err_fd,
                                            run_tmpfs=bool(req.get("private_workdir")))
        deadline = time.monotonic() + float(req["timeout"])
        uid = None if req.get("shared_uid") else req.get("uid")  # never kill a family by uid
        job = self.runs[pid] = Job(req["id"], out_fd, err_fd, deadline, uid=uid)
        job.remove_dir = req["workdir"] if req.get("create_workdir") else None
        job.status_fd = status_fd
        job.exit_fd = exit_fd
        job.init = init
        job.oom_before = oom_before

    def oom_count(self):
        """Kernel OOM kills so far in our memory cgroup (containers), or None if unknown."""
        for path in self.opts.get("oom_events") or ():
            try:
                with open(path) as fh:
                    for line in fh:
                        if line.startswith("oom_kill "):
                            return int(line.split()[1])
            except (OSError, ValueError):
                continue
        return None

    def cancel(self, rid):
        for pid, job in list(self.runs.items()):
            if job.rid == rid:
                job.cancelled = True
                self._kill_tree(pid, job.uid)
        for kernel in self.kernels.values():
            if kernel.job is not None and kernel.job.rid == rid:
                kernel.job.cancelled = True
                self.kill_kernel(kernel)

    def _kill_tree(self, pid, uid=None):
        """Kill a run: its direct children (a pid-namespace init takes its whole namespace
        down), its process group, itself, and in uid mode everything of its uid."""
        kids = children_of(pid)  # before the leader dies and they are re-parented
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        for p in kids + [pid]:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        if uid is not None:
            self.kill_uid(uid)

    def kill_uid(self, uid):
        """SIGKILL every process of ``uid`` at once: a helper takes the uid and calls
        kill(-1), which the kernel applies atomically (no /proc walk racing a fork bomb)."""
        try:
            pid = os.fork()
        except OSError:
            return False
        if pid == 0:
            try:
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
                os.kill(-1, signal.SIGKILL)
            except BaseException:
                pass
            os._exit(0)
        while True:
            try:
                os.wait4(pid, 0)
                break
            except InterruptedError:
                continue
            except ChildProcessError:
                break
        return True

    # -- events
    def on_exit(self, pid, status, ru):
        if self.spare is not None and pid == self.spare[0]:
            self.drop_spare()  # a spare that died before being used
            return
        if pid in self.inits:
            self.inits.discard(pid)
            return
        job = self.runs.pop(pid, None)
        if job is not None:
            self.end_init(getattr(job, "init", None))
            status = run_status(status, job.exit_fd)
            self.sweep(job.uid)
            self.finish(job, status=status, ru=ru)
            if job.remove_dir:
                remove_tree(job.remove_dir)  # after replying: off the run's latency
            return
        kernel = self.kernel_pids.pop(pid, None)
        if kernel is None:
            return
        status = run_status(status, kernel.exit_fd)
        if self.kernels.get(kernel.session) is kernel:
            del self.kernels[kernel.session]
        if kernel.sock is not None:
            self.sel.unregister(kernel.sock)
            kernel.sock.close()
            kernel.sock = None
        self.sweep(kernel.uid)
        if kernel.job is not None:
            job, kernel.job = kernel.job, None
            self.finish(job, status=status, ru=ru, kernel_died=True)

    def sweep(self, uid):
        """After a run: kill whatever it left behind (orphans re-attach to us, the subreaper).
        Cheap when nothing is left: one read of our children list."""
        tracked = self.tracked()
        leftovers = [p for p in children_of(self.pid) if p not in tracked and not _is_zombie(p)]
        if not leftovers:
            return
        if uid is not None:
            if any(real_uid_of(p) == uid for p in leftovers):
                self.kill_uid(uid)
            kill_descendants(self.pid, keep=tracked, uid=uid)
        else:  # pid-namespace inits of finished runs, or plain mode: all untracked children
            kill_descendants(self.pid, keep=tracked)

    def finish(self, job, status=None, ru=None, exit_code=None, kernel_died=False, oom=False):
        out_size, err_size = os.fstat(job.out_fd).st_size, os.fstat(job.err_fd).st_size
        status_fd = getattr(job, "status_fd", None)
        if status_fd is not None:
            oom = oom or os.pread(status_fd, 16, 0).startswith(b"oom")
            os.close(status_fd)
        before = getattr(job, "oom_before", None)
        if before is not None:
            after = self.oom_count()
            oom = oom or (after is not None and after > before)
        header = {"op": "done", "id": job.rid, "status": status, "exit_code": exit_code,
                  "timed_out": job.timed_out, "cancelled": job.cancelled, "oom": oom,
                  "duration": time.monotonic() - job.started,
                  "out_size": out_size, "err_size": err_size, "kernel_died": kernel_died,
                  "restarted": getattr(job, "restarted", False)}
        if ru is not None:
            header["cpu"] = ru.ru_utime + ru.ru_stime
            header["maxrss_kb"] = ru.ru_maxrss
        try:  # outputs go from their memfds to the host without passing through our memory
            self.send(header, fds=[(job.out_fd, min(out_size, self.max_output)),
                                   (job.err_fd, min(err_size, self.max_output))])
        finally:
            os.close(job.out_fd)
            os.close(job.err_fd)

    def check_deadlines(self):
        now = time.monotonic()
        nearest = None
        for pid, job in list(self.runs.items()):
            if job.timed_out or job.cancelled:
                continue
            if job.deadline <= now:
                job.timed_out = True
                self._kill_tree(pid, job.uid)
            elif nearest is None or job.deadline < nearest:
                nearest = job.deadline
        for kernel in list(self.kernels.values()):
            job = kernel.job
            if job is None or job.timed_out or job.cancelled:
                continue
            if job.deadline <= now:
                job.timed_out = True
                self.kill_kernel(kernel)
            elif nearest is None or job.deadline < nearest:
                nearest = job.deadline
        return None if nearest is None else max(0.0, nearest - now)

    def reap(self):
        reap_strays(())
        reaped = bool(_STRAY_EXITS)
        while _STRAY_EXITS:
            pid, (status, ru) = _STRAY_EXITS.popitem()
            self.on_exit(pid, status, ru)
        if reaped and self.stale_dirs:
            for path in list(self.stale_dirs):
                try:
                    os.rmdir(path)
                except FileNotFoundError:
                    pass
                except OSError:
                    continue
                self.stale_dirs.discard(path)

    def shutdown(self):
        self.drop_spare()
        for pid in list(self.runs) + list(self.kernel_pids):
            self._kill_tree(pid)
        kill_descendants(self.pid)
        os._exit(0)

    def on_channel(self):
        """Handle every frame the host has sent so far, payloads straight into memfds."""
        while True:
            try:
                got = self.chan.read_head(block=False)
                if got is False:
                    return
                if got is None:
                    self.shutdown()  # the host went away: leave nothing behind
                header, size = got
                payload = (self.chan.payload_memfd(size)
                           if size or header.get("op") in PAYLOAD_OPS else None)
            except (EOFError, ValueError):
                self.shutdown()  # a truncated or garbled frame: the host is gone or broken
            try:
                self.handle(header, payload)
            finally:
                if payload is not None:
                    os.close(payload)

    def serve(self):
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        # As pid 1 of a container nothing inside can signal us once no handler is installed.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(wake_w)
        os.set_blocking(self.chan.fd_in, False)
        self.sel.register(self.chan.fd_in, selectors.EVENT_READ, ("chan", None))
        self.sel.register(wake_r, selectors.EVENT_READ, ("wake", None))
        timeout = None
        while True:
            for key, _ in self.sel.select(timeout):
                kind, arg = key.data
                if kind == "chan":
                    self.on_channel()
                elif kind == "wake":
                    try:
                        while os.read(wake_r, 4096):
                            pass
                    except (BlockingIOError, InterruptedError):
                        pass
                else:
                    self.on_kernel_readable(arg)
            self.reap()
            timeout = self.check_deadlines()
            self.make_spare()

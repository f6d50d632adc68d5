"""How the zygote forks a run: one fresh child per run in its own pid namespace, a spare forked
ahead of demand while idle, and the namespace's pid 1 (a spawned ``sleep`` on the one-fork path,
else a fork of ours running ``child.pidns_init``). Mixed into ``Zygote``.
"""

import ctypes
import json
import os
import signal
import socket
import time

from .child import pidns_init, spare_child
from .jobs import Job
from .linux import CLONE_NEWPID, SETUP_FAILED_EXIT, _libc, private_run_mounts

#: The uid a spawned pid 1 runs as (no capabilities, nothing of a run's).
INIT_UID = 65534


def init_argv(opts):
    """The command of a run namespace's pid 1 (``sleep infinity``), or None where the fast
    path is not available (no pid namespaces, not root, no ``sleep``)."""
    if not opts.get("pidns") or os.geteuid() != 0 or opts.get("no_fast_init"):
        return None
    for path in ("/usr/bin/sleep", "/bin/sleep"):
        if os.access(path, os.X_OK):
            return [path, "infinity"]
    return None


def spawn_unprivileged(argv):
    """``posix_spawn`` (vfork+exec) ``argv`` as ``INIT_UID``: our real ids are that uid for
    the moment of the spawn and the child takes them (RESETIDS), so its exec keeps no
    capability; ours are untouched (the effective uid stays 0)."""
    os.setresgid(INIT_UID, -1, -1)
    os.setresuid(INIT_UID, -1, -1)
    try:
        return os.posix_spawn(argv[0], argv, {}, resetids=True, setsigdef=(signal.SIGCHLD,))
    finally:
        os.setresuid(0, -1, -1)
        os.setresgid(0, -1, -1)


class Forker:
    """Fork methods of the zygote (``self`` is the ``Zygote``)."""

    def make_spare(self):
        """Fork the next run's child now, while idle (in pid-namespace mode: its pid 1 too,
        with the run's mounts made), so a request only has to wake it."""
        if self.spare is not None or self.opts.get("no_spare"):
            return
        go, go_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        child_fd = go_child.detach()
        fds = (child_fd, self._memfd("stdout"), self._memfd("stderr"), self._memfd("status"))
        try:
            pid, exit_fd, init = self._fork_run(spare_child, (self.opts, fds), fds[2],
                                                run_tmpfs=True)
        except OSError:
            go.close()
            for fd in fds:
                os.close(fd)
            return
        os.close(child_fd)
        self.spare = (pid, go) + fds[1:] + (exit_fd, init)

    def drop_spare(self):
        if self.spare is None:
            return
        pid, go, *fds, init = self.spare
        self.spare = None
        self.end_init(init)
        go.close()  # the spare reads EOF and exits
        for fd in fds:
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass

    def _dispatch_to_spare(self, req, payload):
        """Hand a run (its header and payload memfd) to the waiting spare; returns its pid,
        or None to fork instead."""
        if self.spare is None:
            return None
        pid, go, out_fd, err_fd, status_fd, exit_fd, init = self.spare
        self.spare = None
        try:
            socket.send_fds(go, [json.dumps(req, separators=(",", ":")).encode()], [payload])
        except OSError:  # it died: fall back to a fresh fork
            for fd in (out_fd, err_fd, status_fd, exit_fd):
                if fd is not None:
                    os.close(fd)
            self.end_init(init)
            return None
        finally:
            go.close()
        job = Job(req["id"], out_fd, err_fd, time.monotonic() + float(req["timeout"]),
                  uid=None if req.get("shared_uid") else req.get("uid"))
        job.remove_dir = req["workdir"] if req.get("create_workdir") else None
        job.status_fd = status_fd
        job.exit_fd = exit_fd
        job.init = init
        job.oom_before = self.oom_count()
        self.runs[pid] = job
        return pid

    def _fork_run(self, target, args, err_fd, run_tmpfs):
        """Fork a run (or spare): returns (pid, exit_fd, init).

        Fast path (pid namespaces, root): the namespace's pid 1 is a spawned ``sleep`` (vfork
        and exec, with no capabilities: no copy of our memory) and the run is forked by us
        straight into that namespace as its pid 2, so each run costs one fork of the zygote,
        not two. We reap the run ourselves and kill its pid 1 once it is done, which takes
        everything left in the namespace down. Otherwise ``_fork`` (pid 1 a fork of ours)."""
        if self.init_argv is None:
            pid, exit_fd = self._fork(target, args, err_fd, run_tmpfs)
            return pid, exit_fd, None
        if _libc.unshare(CLONE_NEWPID) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"unshare(CLONE_NEWPID) failed: {os.strerror(err)}")
        init = None
        try:
            init = spawn_unprivileged(self.init_argv)
            self.inits.add(init)
            pid = os.fork()  # the second child of the new namespace: its pid 2
            if pid == 0:
                try:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    if self.opts.get("private_mounts"):
                        private_run_mounts(self.opts, run_tmpfs)
                except BaseException as exc:
                    try:
                        os.write(err_fd, f"palaestra sandbox: setup failed: {exc!r}\n".encode())
                    finally:
                        os._exit(SETUP_FAILED_EXIT)
                target(*args)
                os._exit(1)
        except BaseException:
            self.end_init(init)
            raise
        finally:
            if _libc.setns(self.own_pidns, CLONE_NEWPID) != 0:
                os._exit(70)  # cannot happen; never fork further into a stale namespace
        return pid, None, init

    def end_init(self, init):
        """Kill a run namespace's pid 1 (and so what is left in it); reaped like any child."""
        if init is not None:
            try:
                os.kill(init, signal.SIGKILL)
            except OSError:
                pass

    def _fork(self, target, args, err_fd, run_tmpfs, linger=False):
        """Fork a process that runs ``target(*args)``; returns (pid, exit_fd).

        In pid-namespace mode the child is the pid 1 of a fresh namespace (``pidns_init``) and
        ``exit_fd`` the memfd where it records the run's status; otherwise None."""
        if not self.opts.get("pidns"):
            pid = os.fork()
            if pid == 0:
                target(*args)
                os._exit(1)
            return pid, None
        exit_fd = self._memfd("exit")
        try:
            # The next child is born in a new pid namespace; ours is restored right after, so
            # every other process we fork (helpers, the next run) stays where we are.
            if _libc.unshare(CLONE_NEWPID) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"unshare(CLONE_NEWPID) failed: {os.strerror(err)}")
            try:
                pid = os.fork()
                if pid == 0:
                    pidns_init(self.opts, target, args, exit_fd, err_fd, run_tmpfs, linger)
            finally:
                if _libc.setns(self.own_pidns, CLONE_NEWPID) != 0:
                    os._exit(70)  # cannot happen; never fork further into a stale namespace
        except BaseException:
            os.close(exit_fd)
            raise
        return pid, exit_fd

    # -- requests

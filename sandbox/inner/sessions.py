"""The zygote's side of sessions: working directories with their own tmpfs, and persistent
kernels (started on a session's first cell, fed cells over a socket, retired when they die,
time out or speak nonsense), and their forks (``fork_kernel``; how a kernel forks itself is in
``kernel``). Mixed into ``Zygote``.
"""

import os
import selectors
import signal
import socket
import struct
import time

from .files import copy_tree
from .framing import pack
from .jobs import Family, Job, Kernel
from .kernel import kernel_child
from .linux import mount_tmpfs
from .procs import subtree

#: struct ucred (pid, uid, gid) of SCM_CREDENTIALS
UCRED = struct.Struct("iII")


class KernelHost:
    """Session methods of the zygote (``self`` is the ``Zygote``)."""

    def make_workdir(self, path, uid, quota_mb):
        """A session's directory; with a quota, its own tmpfs of ``quota_mb`` MiB."""
        os.mkdir(path, 0o700)
        if quota_mb:
            self.drop_spare()  # forked before this mount: it would not see it
            mount_tmpfs(path, quota_mb, uid=uid)
        elif uid is not None:
            os.chown(path, uid, uid)

    def start_cell(self, req, payload):
        session = req["session"]
        kernel = self.kernels.get(session)
        restarted = False
        if kernel is None:
            restarted = bool(req.get("had_kernel"))
            kernel = self.start_kernel(req)
        if kernel.job is not None:
            raise RuntimeError(f"session {session!r} is already running a cell")
        out_fd, err_fd = self._memfd("stdout"), self._memfd("stderr")
        job = Job(req["id"], out_fd, err_fd, time.monotonic() + float(req["timeout"]),
                  uid=kernel.uid, session=session)
        job.restarted = restarted
        kernel.job = job
        cell = {"op": "cell", "id": req["id"], "sizes": req.get("blobs", []),
                "has_stdin": bool(req.get("has_stdin"))}
        try:  # the kernel reads code and stdin from the payload memfd itself
            socket.send_fds(kernel.sock, [pack(cell)], [payload, out_fd, err_fd])
        except OSError:
            pass  # the kernel died; its exit is reaped and reported for this cell

    def start_kernel(self, req):
        parent_sock, child_sock = socket.socketpair()
        # the sender's pid (in our namespace) comes with each message: how we learn the pid of
        # an interpreter that lives below its own pid 1
        parent_sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        nursery = req.get("nursery")
        if nursery and not os.path.isdir(nursery):
            os.mkdir(nursery, 0o711)  # ours: the interpreter may pass, never write
        spec = dict(req, _sock_fd=child_sock.fileno(), files=[])
        fds = (self.null, self.null, self.null)
        try:
            pid, exit_fd = self._fork(kernel_child, (self.opts, spec, fds, []), self.null,
                                      run_tmpfs=False, linger=True)
        finally:
            child_sock.close()
        parent_sock.setblocking(False)
        kernel = Kernel(pid, parent_sock, req.get("uid"), req)
        kernel.exit_fd = exit_fd
        kernel.shared_uid = bool(req.get("shared_uid"))
        self.kernels[req["session"]] = kernel
        self.kernel_pids[pid] = kernel
        self.sel.register(parent_sock, selectors.EVENT_READ, ("kernel", req["session"]))
        return kernel

    def stop_kernel(self, session):
        kernel = self.kernels.get(session)
        if kernel is not None:
            self.retire(kernel)

    def retire(self, kernel):
        """Forget a kernel (the next cell of its session starts a fresh one) and kill it."""
        if self.kernels.get(kernel.session) is kernel:
            del self.kernels[kernel.session]
        if kernel.sock is not None:
            self.sel.unregister(kernel.sock)
            kernel.sock.close()
            kernel.sock = None
        family = kernel.family
        if family is None:
            self._kill_tree(kernel.pid, None if kernel.shared_uid else kernel.uid)
            return
        family.members.discard(kernel.session)
        self.kill_kernel(kernel)
        if kernel.job is not None:  # no exit of ours to reap for it: report it now
            job, kernel.job = kernel.job, None
            self.finish(job, status=signal.SIGKILL, kernel_died=True)

    def kill_kernel(self, kernel):
        """Kill a kernel after a timeout or cancel: its namespace, or only its own processes
        when it shares them with a family (whose uid is shared too: no uid-wide kill)."""
        family = kernel.family
        if family is None:
            self._kill_tree(kernel.pid, None if kernel.shared_uid else kernel.uid)
            return
        if kernel.proc is not None:
            for pid in subtree(kernel.proc):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        if not family.members:  # the last one: the holder and the namespace go too
            self._kill_tree(family.init, None)

    def fork_kernel(self, req):
        """Fork the idle interpreter of ``req["session"]`` as ``req["child"]``: the workspace
        copied (by a helper with the session's uid, never through our memory), then the
        interpreter forks itself; the host hears ``ok`` once both have answered."""
        parent = self.kernels.get(req["session"])
        if parent is None or parent.sock is None:
            raise RuntimeError("the session has no live interpreter to fork; run a cell first")
        if parent.job is not None:
            raise RuntimeError("the session is running a cell")
        child_sid = req["child"]
        if child_sid in self.kernels:
            raise RuntimeError(f"session {child_sid!r} exists already")
        uid = parent.uid
        workdir, nursery, parent_nursery = req["workdir"], req["nursery"], req["parent_nursery"]
        os.mkdir(workdir, 0o700)
        if uid is not None:
            os.chown(workdir, uid, uid)
        os.mkdir(nursery, 0o711)
        os.mkdir(parent_nursery, 0o711)
        self.copy_tree(parent.spec["workdir"], workdir, uid)
        ours, theirs = socket.socketpair()
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        ours.setblocking(False)
        spec = dict(parent.spec, session=child_sid, workdir=workdir, nursery=nursery)
        try:
            order = {"op": "fork", "id": req["id"],
                     "child": {"workdir": workdir, "nursery": nursery, "rid": req["id"],
                               "limits": req.get("limits") or {}},
                     "parent": {"nursery": parent_nursery}}
            socket.send_fds(parent.sock, [pack(order)], [theirs.fileno()])
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        if parent.family is None:
            parent.family = Family(parent)
        child = Kernel(None, ours, uid, spec)
        child.shared_uid = parent.shared_uid = True
        child.family = parent.family
        child.family.members.add(child_sid)
        parent.spec = dict(parent.spec, nursery=parent_nursery)
        self.kernels[child_sid] = child
        self.sel.register(ours, selectors.EVENT_READ, ("kernel", child_sid))
        self.forks[req["id"]] = [2, parent, child]  # answers awaited: fork_done, hello

    def copy_tree(self, src, dst, uid):
        """Copy a workspace in a helper process with ``uid`` (symlinks copied as links)."""
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                if uid is not None:
                    os.setgroups([])
                    os.setresgid(uid, uid, uid)
                    os.setresuid(uid, uid, uid)
                copy_tree(src, dst)
                code = 0
            except BaseException as exc:
                try:
                    os.write(2, f"palaestra sandbox: workspace copy failed: {exc!r}\n".encode())
                except BaseException:
                    pass
            os._exit(code)
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError("copying the workspace failed")

    def _fork_answer(self, kernel, header):
        entry = self.forks.get(header.get("id"))
        if entry is None:
            return False
        if header.get("error"):
            del self.forks[header["id"]]
            child = entry[2]
            self.retire(child)
            self.send({"op": "error", "id": header["id"], "error": header["error"]})
            return True
        entry[0] -= 1
        if entry[0] == 0:
            del self.forks[header["id"]]
            self.send({"op": "ok", "id": header["id"]})
        return True

    def _recv_kernel(self, kernel):
        """Bytes from a kernel, and the pid its credentials name (None if none came)."""
        data, anc, _, _ = kernel.sock.recvmsg(1 << 16, socket.CMSG_SPACE(UCRED.size))
        pid = None
        for level, kind, blob in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS \
                    and len(blob) >= UCRED.size:
                pid = UCRED.unpack_from(blob)[0]
        return data, pid

    def on_kernel_readable(self, session):
        kernel = self.kernels.get(session)
        if kernel is None:
            return
        try:
            data, pid = self._recv_kernel(kernel)
        except BlockingIOError:
            return
        except OSError:
            data, pid = b"", None
        if not data:
            self.retire(kernel)  # its exit is reaped and reported for a running cell
            return
        if pid:
            kernel.proc = pid
        try:
            frames = kernel.reader.feed(data)
        except ValueError:
            frames = None
        if frames is None or any(h.get("op") not in ("cell_done", "fork_done", "hello")
                                 for h, _ in frames):
            self.retire(kernel)  # a kernel that speaks nonsense is treated as crashed
            return
        for header, _ in frames:
            if header.get("op") != "cell_done":
                if not self._fork_answer(kernel, header):
                    self.retire(kernel)
                    return
                continue
            job = kernel.job
            if job is None or header.get("id") != job.rid:
                self.retire(kernel)
                return
            kernel.job = None
            code = header.get("exit_code")
            if header.get("oom"):
                self.retire(kernel)  # it kills itself anyway; never send it another cell
            self.finish(job, exit_code=code if isinstance(code, int) else 1,
                        oom=bool(header.get("oom")))

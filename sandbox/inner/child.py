"""The child side of a run: everything between ``fork`` and untrusted code (``setup_child``),
the run body (``run_child``), the spare child forked ahead of demand, and the pid 1 of a run's
own pid namespace (``pidns_init``).
"""

import builtins
import json
import os
import resource
import signal
import socket
import struct
import sys

from .files import write_tree_file
from .linux import (
    PR_SET_DUMPABLE,
    PR_SET_NO_NEW_PRIVS,
    SETUP_FAILED_EXIT,
    _libc,
    drop_capabilities,
    landlock_restrict,
    private_run_mounts,
    seccomp_load,
)
from .payload import blob_spans, read_span, span_memfd
from .procs import _close_all_but

_setrlimit = resource.setrlimit
#: (resource, request key); None = always 0 (no core dumps, no locked memory, no mqueues)
RLIMITS = ((resource.RLIMIT_CPU, "cpu"), (resource.RLIMIT_AS, "as"),
           (resource.RLIMIT_FSIZE, "fsize"), (resource.RLIMIT_NOFILE, "nofile"),
           (resource.RLIMIT_NPROC, "nproc"), (resource.RLIMIT_CORE, None),
           (resource.RLIMIT_MEMLOCK, None), (resource.RLIMIT_MSGQUEUE, None))


def hard_limits():
    """Current hard limits (-1 = unlimited): a child may lower them, never raise them."""
    out = {}
    for res, _ in RLIMITS:
        hard = resource.getrlimit(res)[1]
        out[res] = -1 if hard == resource.RLIM_INFINITY else hard
    return out


def setup_child(opts, req, fds, files=(), payload=None, keep_fd=None):
    """Everything between fork and running untrusted code. Raises on any failure (fail closed).

    ``files`` are ``(name, span)`` blobs of the ``payload`` memfd, written once the run's uid,
    Landlock and seccomp are in force. ``keep_fd`` (a status memfd or a kernel's control
    socket) survives as fd 3; every other inherited fd is closed.
    """
    # A new process group, not a new session: setsid() costs ~5 ms here (scheduler autogroup)
    # and the zygote's session, made by bwrap --new-session, has no controlling terminal.
    os.setpgid(0, 0)
    if payload is not None:
        import fcntl
        payload = fcntl.fcntl(payload, fcntl.F_DUPFD_CLOEXEC, 10)  # clear of 0-3 below
    stdin_fd, out_fd, err_fd = fds
    os.dup2(stdin_fd, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    if keep_fd is not None and keep_fd != 3:
        os.dup2(keep_fd, 3, inheritable=False)
    _close_all_but(([3] if keep_fd is not None else []) + ([payload] if payload is not None
                                                           else []))
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    lim = req["limits"]
    hard = opts["_hard_limits"]
    for res, key in RLIMITS:
        value = 0 if key is None else lim.get(key)
        if value is not None:
            cap = hard[res]
            value = int(value) if cap < 0 else min(int(value), cap)
            _setrlimit(res, (value, value))
    workdir = req["workdir"]
    uid = req.get("uid")
    if req.get("create_workdir"):
        os.mkdir(workdir, 0o700)
        if uid is not None:
            os.chown(workdir, uid, uid)
    elif req.get("private_workdir") and uid is not None:
        os.chown(workdir, uid, uid)  # the run's own tmpfs, mounted by its pid 1
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        # A uid change marks the process non-dumpable, which makes /proc/self/{fd,environ}
        # root-owned and breaks ordinary programs; ptrace stays blocked by seccomp+Landlock.
        _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    elif opts.get("drop_caps"):
        drop_capabilities()
    os.chdir(workdir)
    if opts.get("_landlock"):
        # a session's interpreter may also reach its nursery, where its forks' workspaces go
        nursery = req.get("nursery")
        landlock_restrict(opts["_landlock"], workdir, *([nursery] if nursery else []))
    if opts.get("_seccomp_prog"):
        seccomp_load(opts["_seccomp_prog"])
    else:
        _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    for name, span in files:
        write_tree_file(workdir, name, payload, span)
    if payload is not None:
        os.close(payload)
    # The zygote's environment is already the scrubbed run environment.
    env = os.environ
    env["HOME"] = env["TMPDIR"] = env["PWD"] = workdir
    for key, value in req.get("env", {}).items():
        env[key] = value
    return workdir


def _exit_code_of(exc):
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(str(code) + "\n")
    except Exception:
        pass
    return 1


def _finish_python():
    """What the interpreter does at exit: join threads (if any were used), atexit hooks."""
    threading = sys.modules.get("threading")
    if threading is not None:
        try:
            threading._shutdown()
        except BaseException:
            pass
    try:
        import atexit
        atexit._run_exitfuncs()
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass


def _print_user_traceback():
    """Like the interpreter's own report, without this runner's frame."""
    import traceback
    try:
        etype, exc, tb = sys.exc_info()
        traceback.print_exception(etype, exc, tb.tb_next if tb is not None else None)
    except BaseException:
        pass


def exec_python(code, namespace, filename="<string>"):
    """Run ``code`` like ``python -c``; returns (exit code, hit MemoryError)."""
    try:
        exec(compile(code, filename, "exec"), namespace)
        return 0, False
    except SystemExit as exc:
        return _exit_code_of(exc), False
    except MemoryError:
        _print_user_traceback()
        return 1, True
    except BaseException:
        _print_user_traceback()
        return 1, False


def run_child(opts, req, fds, payload):
    """Body of a forked run child; never returns.

    ``fds``: stdout and stderr memfds (and, for python, the status memfd); ``payload``: the
    run's memfd (meta: code, argv and file names; then the files; then stdin), read only here.
    """
    try:
        spans = blob_spans(req.get("blobs", []))
        meta = json.loads(read_span(payload, spans[0]))
        names = meta.get("files", [])
        files = list(zip(names, spans[1:1 + len(names)]))
        in_fd = (span_memfd(payload, spans[1 + len(names)], "stdin") if req.get("has_stdin")
                 else os.open(os.devnull, os.O_RDONLY))
    except BaseException as exc:
        try:
            os.write(fds[1], (f"palaestra sandbox: setup failed: {exc!r}\n").encode())
        finally:
            os._exit(SETUP_FAILED_EXIT)
    try:
        status_fd = fds[2] if len(fds) > 2 else None
        workdir = setup_child(opts, req, (in_fd,) + tuple(fds[:2]), files, payload,
                              keep_fd=status_fd)
    except BaseException as exc:
        try:
            os.write(2, (f"palaestra sandbox: setup failed: {exc!r}\n").encode())
        finally:
            os._exit(SETUP_FAILED_EXIT)
    try:
        if req["kind"] == "exec":
            for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            argv = meta["argv"]
            try:
                os.execvpe(argv[0], argv, os.environ)
            except OSError as exc:
                os.write(2, (f"{argv[0]}: {exc.strerror}\n").encode())
                os._exit(127)
        import types
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = main
        sys.argv = ["-c"]
        sys.path.insert(0, workdir)
        code, oom = exec_python(meta["code"], main.__dict__)
        _finish_python()
        if oom:
            try:
                os.write(3, b"oom")  # fd 3: the zygote's status memfd for this run
            except OSError:
                pass
            os.kill(os.getpid(), signal.SIGKILL)  # report like the kernel OOM killer: 137
            code = 128 + signal.SIGKILL
    except BaseException:
        code = 1
    os._exit(code)


def spare_child(opts, fds):
    """A child forked ahead of demand: it waits for its request, then becomes a run child.

    Forking while the zygote is idle takes the fork off the request's critical path. The spare
    learns its request (a small header and the payload memfd) over its own socket when woken,
    and it serves exactly one run like any other child.
    """
    go_fd, out_fd, err_fd, status_fd = fds
    try:
        _close_all_but(fds)
        os.setpgid(0, 0)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        go = socket.socket(fileno=go_fd)
        while True:
            try:
                msg, got, _, _ = socket.recv_fds(go, 1 << 16, 1)
                break
            except InterruptedError:
                continue
        if not msg or not got:
            os._exit(0)  # the zygote is gone or no longer needs us
        go.close()
        req = json.loads(msg)
    except BaseException as exc:
        try:
            os.write(err_fd, (f"palaestra sandbox: setup failed: {exc!r}\n").encode())
        finally:
            os._exit(SETUP_FAILED_EXIT)
    run_child(opts, req, (out_fd, err_fd, status_fd), got[0])


def pidns_init(opts, target, args, exit_fd, err_fd, run_tmpfs, linger=False):
    """pid 1 of a run's fresh pid namespace; the run itself is pid 2.

    The run is never pid 1, so its signals behave as anywhere else (pid 1 ignores SIGTERM
    sent by itself) and it cannot signal its parent (another uid, or outside its Landlock
    domain: EPERM). This process forks the run at once and keeps no capabilities after; it
    reaps, writes the run's wait status to ``exit_fd`` (a memfd only the zygote and it hold)
    and exits, and the kernel then kills everything left in the namespace. It does as little
    as it can: each page it writes is copied once for it and once more for the run.
    The run makes its private mounts itself (``private_run_mounts``) before anything else.
    ``linger`` (a session's interpreter): after recording its status, reap on until no child is
    left, so the forks of a session (re-parented here) outlive the interpreter they came from.
    """
    try:
        os.setpgid(0, 0)
        signal.set_wakeup_fd(-1)
        pid = os.fork()
    except BaseException as exc:
        try:
            os.write(err_fd, (f"palaestra sandbox: setup failed: {exc!r}\n").encode())
        finally:
            os._exit(SETUP_FAILED_EXIT)
    if pid == 0:
        try:
            os.close(exit_fd)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            if opts.get("private_mounts"):
                private_run_mounts(opts, run_tmpfs)
        except BaseException as exc:
            try:
                os.write(err_fd, (f"palaestra sandbox: setup failed: {exc!r}\n").encode())
            finally:
                os._exit(SETUP_FAILED_EXIT)
        target(*args)
        os._exit(1)
    code = 1  # no status recorded: the zygote reports this exit (and the run is killed)
    try:
        _close_all_but((exit_fd,))
        drop_capabilities(bounding=False)  # it never execs
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        while True:
            try:
                done, status = os.waitpid(-1, 0)
            except InterruptedError:
                continue
            if done == pid:
                break
        os.pwrite(exit_fd, struct.pack("<i", status), 0)
        code = 0
        while linger:
            try:
                os.waitpid(-1, 0)
            except InterruptedError:
                continue
            except ChildProcessError:
                break
    finally:
        os._exit(code)


def run_status(status, exit_fd):
    """The run's wait status: what its pid 1 recorded, or how pid 1 itself ended (killed)."""
    if exit_fd is None:
        return status
    data = os.pread(exit_fd, 4, 0)
    os.close(exit_fd)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and len(data) == 4:
        return struct.unpack("<i", data)[0]
    return status

"""In-sandbox agent: a zygote that forks one fresh, isolated child per run, plus persistent kernels.

The host never imports this module: it reads its source and starts it as
``python -I -c SOURCE '<json options>'`` *inside* the isolation boundary (bubblewrap, an
``unshare`` network namespace, or a Docker container). It uses the standard library only (the
palaestra package is not visible in the sandbox) and trusts nothing its children send back.

Why a zygote: starting an interpreter costs ~8-35 ms here; forking an already started one with
its modules imported costs ~1-3 ms (a spare child is forked ahead of demand while the zygote is
idle). Each run gets a fresh pid namespace whose pid 1 (``pidns_init``) gives it its own mount
namespace (a /proc showing only the run, a size-limited tmpfs workspace) and forks the run as
pid 2, which applies, in this order: new process group, fresh stdio (memfds owned by the
zygote, so output survives a kill and is capped by RLIMIT_FSIZE), rlimits, its own uid (root
hosts), the working directory, Landlock (filesystem, TCP, signal and abstract-socket scoping)
and a seccomp filter compiled once on the host. Children are never reused. When the run ends
its pid 1 exits and the kernel kills whatever the run left behind; without pid namespaces
(Docker) the zygote, a child subreaper, kills the leftovers before it reports.

Wire format (both directions): 4-byte big-endian frame length, 4-byte header length, a JSON
header and raw blobs whose lengths are listed in ``header["blobs"]``. The blobs of a request
(a run's code, argv, files and stdin; a cell; a written file) are payload: the zygote reads
only the header and has the kernel move the blobs into a memfd that it hands to the run
unread; outputs and read files go back from memfds the same way. Every run is a fork of the
zygote, so a payload byte in its memory, even freed, would be readable by every later run.
"""

import ctypes
import errno
import json
import os
import resource
import select
import selectors
import signal
import socket
import struct
import sys
import time

PR_SET_DUMPABLE = 4
PR_SET_SECCOMP = 22
PR_CAPBSET_DROP = 24
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_MODE_FILTER = 2
CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE, MS_SLAVE = 4096, 16384, 1 << 18, 1 << 19
MNT_DETACH = 2
SYS_LANDLOCK_CREATE_RULESET = 444
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446
LL_FS_READ = 1 | 4 | 8  # EXECUTE | READ_FILE | READ_DIR
LL_FS_DEV = 2 | 4  # WRITE_FILE | READ_FILE (+ TRUNCATE from ABI 3, added below)
SETUP_FAILED_EXIT = 126
MAX_CHILD_FRAME = 1 << 20
#: Requests whose blobs are payload (handed on as a memfd, never read by the zygote).
PAYLOAD_OPS = ("run", "cell", "write_file")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                        ctypes.c_ulong]
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


# --------------------------------------------------------------------------- framing
def pack(header, blobs=()):
    header = dict(header, blobs=[len(b) for b in blobs])
    head = json.dumps(header, separators=(",", ":")).encode()
    body = b"".join([struct.pack(">I", len(head)), head, *blobs])
    return struct.pack(">I", len(body)) + body


class FrameReader:
    """Accumulates bytes and yields complete ``(header, blobs)`` frames."""

    def __init__(self, max_frame):
        self.buf = bytearray()
        self.max_frame = max_frame

    def feed(self, data):
        self.buf += data
        frames = []
        while len(self.buf) >= 4:
            (size,) = struct.unpack_from(">I", self.buf)
            if size > self.max_frame:
                raise ValueError(f"frame of {size} bytes exceeds the limit")
            if len(self.buf) < 4 + size:
                break
            body = bytes(self.buf[4:4 + size])
            del self.buf[:4 + size]
            (hlen,) = struct.unpack_from(">I", body)
            header = json.loads(body[4:4 + hlen])
            blobs, pos = [], 4 + hlen
            for n in header.get("blobs", []):
                blobs.append(body[pos:pos + n])
                pos += n
            frames.append((header, blobs))
        return frames


# --------------------------------------------------------------------------- payloads
# What a run receives (code, argv, stdin, files) and what it prints are *payload*. The zygote
# never holds payload bytes in its own memory: every later run is a fork of it and could scan
# its inherited heap (freed memory included) for an earlier run's hidden tests or output. The
# kernel moves payloads instead: splice() from the host channel into a memfd, sendfile() from
# memfds into files, to the host, or into a run's stdin. Only the small JSON headers (ids,
# limits, paths chosen by the host) are parsed here.
def blob_spans(sizes):
    """(offset, length) of each blob of a payload memfd, from the header's size list."""
    spans, pos = [], 0
    for n in sizes:
        spans.append((pos, int(n)))
        pos += int(n)
    return spans


def read_span(fd, span):
    """A blob's bytes (only ever called in the run or kernel that owns the payload)."""
    off, n = span
    parts = []
    while n:
        part = os.pread(fd, n, off)
        if not part:
            raise OSError(errno.EIO, "payload ended early")
        parts.append(part)
        off += len(part)
        n -= len(part)
    return b"".join(parts)


def copy_span(dst, src, span):
    """Copy a blob of ``src`` to ``dst``'s file position, inside the kernel (sendfile)."""
    off, n = span
    while n:
        k = os.sendfile(dst, src, off, n)
        if not k:
            raise OSError(errno.EIO, "payload ended early")
        off += k
        n -= k


def span_memfd(src, span, name):
    """A fresh memfd holding one blob, positioned at its start (a run's stdin)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        copy_span(fd, src, span)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _wait(fd, write=False):
    select.select([] if write else [fd], [fd] if write else [], [])


class _Bounce:
    """Fallback copy through one fixed buffer that is zeroed after every use, for channels
    the kernel cannot splice (no new bytes object is ever made from a payload)."""

    def __init__(self, size=1 << 16):
        self.buf = bytearray(size)
        self.addr = ctypes.addressof((ctypes.c_char * size).from_buffer(self.buf))

    def move(self, src, dst, n, src_off=None):
        view = memoryview(self.buf)
        try:
            while n:
                want = min(n, len(self.buf))
                try:
                    k = (os.readv(src, [view[:want]]) if src_off is None
                         else os.preadv(src, [view[:want]], src_off))
                except BlockingIOError:
                    _wait(src)
                    continue
                if not k:
                    return n  # short: the caller decides
                done = 0
                while done < k:
                    try:
                        done += os.write(dst, view[done:k])
                    except BlockingIOError:
                        _wait(dst, write=True)
                n -= k
                if src_off is not None:
                    src_off += k
            return 0
        finally:
            view.release()
            ctypes.memset(self.addr, 0, len(self.buf))


class Channel:
    """The host link, read exactly one frame at a time: the header into memory, the payload
    (the frame's blobs) moved by the kernel straight into a memfd."""

    def __init__(self, fd_in, fd_out):
        self.fd_in, self.fd_out = fd_in, fd_out
        self.pipe_r, self.pipe_w = os.pipe2(os.O_CLOEXEC)
        try:
            import fcntl
            fcntl.fcntl(self.pipe_w, fcntl.F_SETPIPE_SZ, 1 << 20)
            self.pipe_cap = fcntl.fcntl(self.pipe_w, fcntl.F_GETPIPE_SZ)
        except OSError:
            self.pipe_cap = 1 << 16
        self.splice_in = self.send_out = True
        self.bounce = None

    def _read_exact(self, n, first=None):
        parts = [first] if first else []
        n -= len(first or b"")
        while n > 0:
            try:
                data = os.read(self.fd_in, n)
            except BlockingIOError:
                _wait(self.fd_in)
                continue
            except InterruptedError:
                continue
            if not data:
                return None
            parts.append(data)
            n -= len(data)
        return b"".join(parts)

    def read_head(self, block=True):
        """(header, payload size) of the next frame; None at EOF; False when none waits
        (``block=False``)."""
        try:
            first = os.read(self.fd_in, 8)
        except BlockingIOError:
            if not block:
                return False
            first = b""
        except InterruptedError:
            first = b""
        if not first and not block:
            return None
        prefix = self._read_exact(8, first)
        if prefix is None:
            return None
        size, hlen = struct.unpack(">II", prefix)
        head = self._read_exact(hlen)
        if head is None:
            return None
        return json.loads(head), size - 4 - hlen

    def read_payload_bytes(self, n):
        """A payload that the zygote itself needs (the seccomp filter of ``init``)."""
        return self._read_exact(n) if n else b""

    def payload_memfd(self, n):
        """The next ``n`` bytes of the channel in a fresh memfd, never in our memory."""
        fd = os.memfd_create("payload", os.MFD_CLOEXEC)
        try:
            while n and self.splice_in:
                try:
                    k = os.splice(self.fd_in, self.pipe_w, min(n, self.pipe_cap))
                except BlockingIOError:
                    _wait(self.fd_in)
                    continue
                except InterruptedError:
                    continue
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                        raise
                    self.splice_in = False
                    break
                if not k:
                    raise EOFError("the host closed the channel mid-frame")
                n -= k
                while k:
                    k -= os.splice(self.pipe_r, fd, k)
            if n:
                self.bounce = self.bounce or _Bounce()
                if self.bounce.move(self.fd_in, fd, n):
                    raise EOFError("the host closed the channel mid-frame")
            return fd
        except BaseException:
            os.close(fd)
            raise

    def write_all(self, data):
        data = memoryview(data)
        while data:
            try:
                data = data[os.write(self.fd_out, data):]
            except InterruptedError:
                continue
            except BlockingIOError:  # the channel is non-blocking: wait until the host reads
                _wait(self.fd_out, write=True)

    def send(self, header, blobs=(), fds=()):
        """One frame: ``blobs`` from memory, then each ``(fd, n)`` of ``fds`` (the first n
        bytes of a memfd) copied by the kernel. A file shorter than announced is padded."""
        sizes = [len(b) for b in blobs] + [n for _, n in fds]
        head = json.dumps(dict(header, blobs=sizes), separators=(",", ":")).encode()
        total = 4 + len(head) + sum(sizes)
        self.write_all(b"".join([struct.pack(">II", total, len(head)), head, *blobs]))
        for fd, n in fds:
            off = 0
            while off < n and self.send_out:
                try:
                    k = os.sendfile(self.fd_out, fd, off, n - off)
                except BlockingIOError:
                    _wait(self.fd_out, write=True)
                    continue
                except InterruptedError:
                    continue
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                        raise
                    self.send_out = False
                    break
                if not k:
                    break
                off += k
            if off < n and not self.send_out:
                self.bounce = self.bounce or _Bounce()
                off = n - self.bounce.move(fd, self.fd_out, n - off, src_off=off)
            if off < n:
                self.write_all(bytes(n - off))


# --------------------------------------------------------------------------- kernel features
class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def landlock_abi():
    abi = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(int(abi), 0)


def landlock_prepare(abi, ro_paths, dev_paths):
    """Precompute (in the zygote) the ruleset attributes and the fixed rules of every child:
    read/exec below ``ro_paths``, read/write of existing files below ``dev_paths``."""
    fs_all = (1 << 13) - 1
    if abi >= 2:
        fs_all |= 1 << 13  # REFER
    if abi >= 3:
        fs_all |= 1 << 14  # TRUNCATE
    if abi >= 5:
        fs_all |= 1 << 15  # IOCTL_DEV
    attr = _RulesetAttr(fs_all, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)
    size = ctypes.sizeof(_RulesetAttr) if abi >= 6 else (16 if abi >= 4 else 8)
    dev_rights = LL_FS_DEV | ((1 << 14) if abi >= 3 else 0)
    file_mask = 1 | 2 | 4 | (1 << 14) | (1 << 15)
    rules = []
    for paths, rights in ((ro_paths, LL_FS_READ), (dev_paths, dev_rights)):
        for path in paths:
            if os.path.exists(path):
                rules.append((path, (rights if os.path.isdir(path) else rights & file_mask)
                              & fs_all))
    return {"attr": attr, "size": ctypes.c_size_t(size), "fs_all": fs_all, "rules": rules,
            "zero": ctypes.c_uint32(0)}


def landlock_restrict(prep, workdir):
    """Deny all filesystem access but the prepared rules plus everything below ``workdir``;
    deny TCP bind/connect (ABI >= 4) and signals/abstract sockets leaving the domain (>= 6)."""
    syscall = _libc.syscall
    fd = syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(prep["attr"]), prep["size"],
                 prep["zero"])
    if fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        for path, rights in prep["rules"] + [(workdir, prep["fs_all"])]:
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneath(rights, pfd)
                if syscall(SYS_LANDLOCK_ADD_RULE, fd, 1, ctypes.byref(rule), 0) != 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule({path}) failed")
            finally:
                os.close(pfd)
        if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
        if syscall(SYS_LANDLOCK_RESTRICT_SELF, fd, 0) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(fd)


def seccomp_prepare(bpf):
    """Build the ``sock_fprog`` once in the zygote; children only make the prctl call."""
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = _SockFprog(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p))
    return (buf, prog, ctypes.addressof(prog))


def seccomp_load(prepared):
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
    if _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, prepared[2], 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "loading the seccomp filter failed")


_CAP_ARGS = []


def capset_args():
    """capset's function and arguments, built once in the zygote (``warm_up``): building
    them in each run's pid 1 cost ~90 copied pages and 0.5 ms there."""
    if not _CAP_ARGS:
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
        _CAP_ARGS.extend((_libc.capset, header, (ctypes.c_uint32 * 6)()))
    return _CAP_ARGS


def drop_capabilities():
    """Clear every capability set and the bounding set (used when the uid stays 0)."""
    capset, header, data = capset_args()
    prctl = _libc.prctl
    for cap in range(64):
        if prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
            break
    if capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


# --------------------------------------------------------------------------- mounts
def _b(text):
    return None if text is None else text.encode()


def mount(source, target, fstype, flags, data=None):
    if _libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype or source} on {target}: {os.strerror(err)}")


def mount_tmpfs(path, size_mb, mode=0o700, uid=None):
    """A size-limited tmpfs at ``path``: a workspace that cannot fill anyone else's."""
    data = f"size={int(size_mb)}m,mode={mode:o}"
    if uid is not None:
        data += f",uid={uid},gid={uid}"
    mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, data)


def unmount(path):
    """Detach a mount at ``path``; False when nothing was mounted there."""
    return _libc.umount2(_b(path), MNT_DETACH) == 0


def private_mount_ns(slave=True):
    """Enter a new mount namespace that receives no mounts from ours and sends none back."""
    if _libc.unshare(CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNS) failed: {os.strerror(err)}")
    mount(None, "/", None, MS_REC | (MS_SLAVE if slave else MS_PRIVATE))


def expose_dirs(dirs):
    """Make each of ``dirs`` reachable by unprivileged uids although a parent directory is
    not world-searchable (an interpreter under /root): in our private mount namespace the
    closed parent is covered by a tmpfs holding only the paths to those dirs, each bound back.
    Nothing else below that parent stays visible."""
    groups = {}
    for d in dirs:
        parts = [p for p in d.split("/") if p]
        for i in range(1, len(parts)):
            parent = "/" + "/".join(parts[:i])
            if not os.stat(parent).st_mode & 0o001:
                groups.setdefault(parent, []).append(d)
                break
    for parent, members in groups.items():
        fds = [os.open(d, os.O_PATH | os.O_CLOEXEC) for d in members]
        mount_tmpfs(parent, 1, mode=0o755)
        for d, fd in zip(members, fds):
            os.makedirs(d, 0o755, exist_ok=True)
            mount(f"/proc/self/fd/{fd}", d, None, MS_BIND | MS_REC)
            os.close(fd)
    return sorted(groups)


def prepare_zygote_mounts(opts):
    """Mounts of the zygote's own namespace, before anything is forked (see local.py)."""
    if opts.get("own_mountns"):
        private_mount_ns(slave=False)
    exposed = expose_dirs(opts.get("expose") or [])
    root = opts.get("root_tmpfs")
    if root:
        mount_tmpfs(root["path"], root["mb"], mode=0o711)
    run_dir = opts.get("run_dir")
    if run_dir and not os.path.isdir(run_dir):
        os.mkdir(run_dir, 0o711)
    return exposed


def private_run_mounts(opts, run_tmpfs):
    """In a run's pid-1: its own mount namespace with a /proc that shows only its own pid
    namespace (hidepid: nor processes of other uids), and its own size-limited workspace."""
    private_mount_ns()
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible")
    if run_tmpfs and opts.get("run_dir"):
        mount_tmpfs(opts["run_dir"], opts["quota_mb"])


def children_of(pid):
    # Our own children through thread-self: correct even where getpid() is namespaced.
    path = ("/proc/thread-self/children" if pid == os.getpid()
            else f"/proc/{pid}/task/{pid}/children")
    try:
        with open(path) as fh:
            return [int(x) for x in fh.read().split()]
    except OSError:
        return []


def real_uid_of(pid):
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def subtree(pid):
    out, stack = [], [pid]
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(children_of(p))
    return out


def kill_descendants(root, keep=(), uid=None, budget_s=2.0):
    """SIGKILL every descendant of ``root`` except ``keep`` (and their subtrees).

    ``root`` is a child subreaper, so orphans re-attach to it; repeated rounds catch processes
    forked while we kill. With ``uid`` set only processes of that real uid are touched.
    Returns True when nothing is left. Bounded in time: a process stuck in uninterruptible
    sleep (e.g. a fork bomb blocked on a kernel lock) dies when it wakes, we do not spin on it.
    """
    deadline = time.monotonic() + budget_s
    pause = 0.0005
    while time.monotonic() < deadline:
        victims = []
        for kid in children_of(root):
            if kid in keep:
                continue
            if uid is not None and real_uid_of(kid) != uid:
                continue
            victims.extend(subtree(kid))
        live = [p for p in victims if not _is_zombie(p)]
        if not live:
            return True
        for p in live:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        reap_strays(keep)
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    return False


def _is_zombie(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
        return data[data.rindex(b")") + 2:data.rindex(b")") + 3] in (b"Z", b"X")
    except (OSError, ValueError):
        return True


_STRAY_EXITS = {}


def reap_strays(keep):
    """Reap exited children; statuses of tracked pids are parked for the main loop."""
    while True:
        try:
            pid, status, ru = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _STRAY_EXITS[pid] = (status, ru)


# --------------------------------------------------------------------------- child side
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


def remove_tree(path):
    """Delete a run's directory without following anything the run planted in it."""
    try:
        os.rmdir(path)  # the common case: a trivial run leaves an empty directory
        return
    except FileNotFoundError:
        return
    except OSError:
        pass
    import shutil
    shutil.rmtree(path, ignore_errors=True)  # fd-based on Linux: symlinks are not followed
def _close_fds_from(low):
    try:
        os.closerange(low, 1 << 20)
    except OSError:
        pass


def _safe_open_parent(root_fd, rel, create_dirs):
    """Walk ``rel`` below ``root_fd`` without following symlinks; return (dir_fd, name)."""
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or any(p == ".." for p in parts):
        raise ValueError(f"bad path {rel!r}: use a relative path inside the workspace")
    fd = os.dup(root_fd)
    try:
        for part in parts[:-1]:
            try:
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                if not create_dirs:
                    raise
                os.mkdir(part, 0o755, dir_fd=fd)
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1]


def write_tree_file(root, rel, src, span, mode=0o644, owner=None):
    """Write blob ``span`` of payload memfd ``src`` to ``root/rel`` (kernel copy)."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        dfd, name = _safe_open_parent(root_fd, rel, create_dirs=True)
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                         | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dfd)
            try:
                if owner is not None:
                    os.fchown(fd, owner[0], owner[1])
                copy_span(fd, src, span)
            finally:
                os.close(fd)
        finally:
            os.close(dfd)
    finally:
        os.close(root_fd)


def read_tree_file(root, rel, limit):
    """A memfd holding ``root/rel`` (at most ``limit`` bytes, else ValueError), copied by the
    kernel: the file never passes through our memory and cannot change while it is sent."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        dfd, name = _safe_open_parent(root_fd, rel, create_dirs=False)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=dfd)
            try:
                import stat as _stat
                if not _stat.S_ISREG(os.fstat(fd).st_mode):
                    raise IsADirectoryError(f"{rel!r} is not a regular file")
                out = os.memfd_create("read_file", os.MFD_CLOEXEC)
                total = 0
                try:
                    while total <= limit:
                        k = os.sendfile(out, fd, None, min(1 << 24, limit + 1 - total))
                        if not k:
                            break
                        total += k
                    if total > limit:
                        raise ValueError(f"{rel!r} is larger than {limit} bytes")
                except BaseException:
                    os.close(out)
                    raise
                return out, total
            finally:
                os.close(fd)
        finally:
            os.close(dfd)
    finally:
        os.close(root_fd)


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
        landlock_restrict(opts["_landlock"], workdir)
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
        main.__dict__["__builtins__"] = __builtins__
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


def _close_all_but(keep):
    """Close every fd >= 3 except ``keep`` (a few close_range calls over the gaps)."""
    low = 3
    for fd in sorted(set(keep)):
        if fd >= low:
            if fd > low:
                os.closerange(low, fd)
            low = fd + 1
    _close_fds_from(low)


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


def pidns_init(opts, target, args, exit_fd, err_fd, run_tmpfs):
    """pid 1 of a run's fresh pid namespace; the run itself is pid 2.

    The run is never pid 1, so its signals behave as anywhere else (pid 1 ignores SIGTERM
    sent by itself) and it cannot signal its parent (another uid, or outside its Landlock
    domain: EPERM). This process forks the run at once and keeps no capabilities after; it
    reaps, writes the run's wait status to ``exit_fd`` (a memfd only the zygote and it hold)
    and exits, and the kernel then kills everything left in the namespace. It does as little
    as it can: each page it writes is copied once for it and once more for the run.
    The run makes its private mounts itself (``private_run_mounts``) before anything else.
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
        drop_capabilities()
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


# --------------------------------------------------------------------------- persistent kernel
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
        kernel_loop(sock, workdir, pidns=bool(opts.get("pidns")))
    finally:
        os._exit(1)


def _kill_cell_leftovers(pidns):
    """Nothing a cell started may outlive it (only the kernel itself survives)."""
    if pidns:  # our namespace holds only this session: kill(-1) reaches all but pid 1 and us
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


def kernel_loop(sock, workdir, pidns=False):
    import types
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    sys.argv = [""]
    sys.path.insert(0, workdir)
    # Orphans of a cell re-attach here, so one sweep after each cell finds all of them.
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    reader = FrameReader(1 << 30)
    null = os.open(os.devnull, os.O_RDWR)
    fd_queue = []
    while True:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
        if not data:
            os._exit(0)
        fd_queue.extend(fds)
        for header, _ in reader.feed(data):
            # The cell's payload memfd (code, then stdin), its stdout and stderr memfds.
            (payload, out_fd, err_fd), fd_queue = fd_queue[:3], fd_queue[3:]
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
            code, oom = exec_python(code_text, main.__dict__, filename="<cell>")
            del code_text
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except BaseException:
                    pass
            for target in (0, 1, 2):
                os.dup2(null, target)
            _kill_cell_leftovers(pidns)
            sock.sendall(pack({"op": "cell_done", "id": header.get("id"),
                               "exit_code": 128 + signal.SIGKILL if oom else code, "oom": oom}))
            if oom:  # its heap may be wrecked: the next cell gets a fresh interpreter
                os.kill(os.getpid(), signal.SIGKILL)


# --------------------------------------------------------------------------- zygote
class Job:
    """One run (or one kernel cell) the zygote is waiting for."""

    def __init__(self, rid, out_fd, err_fd, deadline, uid=None, session=None):
        self.rid = rid
        self.out_fd = out_fd
        self.err_fd = err_fd
        self.deadline = deadline
        self.uid = uid
        self.session = session
        self.started = time.monotonic()
        self.timed_out = False
        self.cancelled = False
        self.exit_fd = None


class Kernel:
    def __init__(self, pid, sock, uid, spec):
        self.pid = pid
        self.session = spec["session"]
        self.sock = sock
        self.uid = uid
        self.spec = spec
        self.reader = FrameReader(MAX_CHILD_FRAME)
        self.job = None
        self.exit_fd = None


class Zygote:
    def __init__(self, chan, opts):
        self.chan = chan
        self.opts = opts
        self.pid = os.getpid()
        self.runs = {}  # leader pid -> Job
        self.kernels = {}  # session -> live Kernel
        self.kernel_pids = {}  # pid -> Kernel (live or retired, until reaped)
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
        out = set(self.runs) | set(self.kernel_pids)
        if self.spare is not None:
            out.add(self.spare[0])
        return out

    def make_spare(self):
        """Fork the next run's child now, while idle (in pid-namespace mode: its pid 1 too,
        with the run's mounts made), so a request only has to wake it."""
        if self.spare is not None or self.opts.get("no_spare"):
            return
        go, go_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        child_fd = go_child.detach()
        fds = (child_fd, self._memfd("stdout"), self._memfd("stderr"), self._memfd("status"))
        try:
            pid, exit_fd = self._fork(spare_child, (self.opts, fds), fds[2], run_tmpfs=True)
        except OSError:
            go.close()
            for fd in fds:
                os.close(fd)
            return
        os.close(child_fd)
        self.spare = (pid, go) + fds[1:] + (exit_fd,)

    def drop_spare(self):
        if self.spare is None:
            return
        pid, go, *fds = self.spare
        self.spare = None
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
        pid, go, out_fd, err_fd, status_fd, exit_fd = self.spare
        self.spare = None
        try:
            socket.send_fds(go, [json.dumps(req, separators=(",", ":")).encode()], [payload])
        except OSError:  # it died: fall back to a fresh fork
            for fd in (out_fd, err_fd, status_fd, exit_fd):
                if fd is not None:
                    os.close(fd)
            return None
        finally:
            go.close()
        job = Job(req["id"], out_fd, err_fd, time.monotonic() + float(req["timeout"]),
                  uid=req.get("uid"))
        job.remove_dir = req["workdir"] if req.get("create_workdir") else None
        job.status_fd = status_fd
        job.exit_fd = exit_fd
        job.oom_before = self.oom_count()
        self.runs[pid] = job
        return pid

    def _fork(self, target, args, err_fd, run_tmpfs):
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
                    pidns_init(self.opts, target, args, exit_fd, err_fd, run_tmpfs)
            finally:
                if _libc.setns(self.own_pidns, CLONE_NEWPID) != 0:
                    os._exit(70)  # cannot happen; never fork further into a stale namespace
        except BaseException:
            os.close(exit_fd)
            raise
        return pid, exit_fd

    # -- requests
    def handle(self, header, payload):
        op = header.get("op")
        try:
            if op == "run":
                self.start_run(header, payload)
            elif op == "cell":
                self.start_cell(header, payload)
            elif op == "cancel":
                self.cancel(header["id"])
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

    def make_workdir(self, path, uid, quota_mb):
        """A session's directory; with a quota, its own tmpfs of ``quota_mb`` MiB."""
        os.mkdir(path, 0o700)
        if quota_mb:
            self.drop_spare()  # forked before this mount: it would not see it
            mount_tmpfs(path, quota_mb, uid=uid)
        elif uid is not None:
            os.chown(path, uid, uid)

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
        pid, exit_fd = self._fork(run_child, (self.opts, req, fds, payload), err_fd,
                                  run_tmpfs=bool(req.get("private_workdir")))
        deadline = time.monotonic() + float(req["timeout"])
        job = self.runs[pid] = Job(req["id"], out_fd, err_fd, deadline, uid=req.get("uid"))
        job.remove_dir = req["workdir"] if req.get("create_workdir") else None
        job.status_fd = status_fd
        job.exit_fd = exit_fd
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
        spec = dict(req, _sock_fd=child_sock.fileno(), files=[])
        fds = (self.null, self.null, self.null)
        try:
            pid, exit_fd = self._fork(kernel_child, (self.opts, spec, fds, []), self.null,
                                      run_tmpfs=False)
        finally:
            child_sock.close()
        parent_sock.setblocking(False)
        kernel = Kernel(pid, parent_sock, req.get("uid"), req)
        kernel.exit_fd = exit_fd
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
        self._kill_tree(kernel.pid, kernel.uid)

    def cancel(self, rid):
        for pid, job in list(self.runs.items()):
            if job.rid == rid:
                job.cancelled = True
                self._kill_tree(pid, job.uid)
        for kernel in self.kernels.values():
            if kernel.job is not None and kernel.job.rid == rid:
                kernel.job.cancelled = True
                self._kill_tree(kernel.pid, kernel.uid)

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
    def on_kernel_readable(self, session):
        kernel = self.kernels.get(session)
        if kernel is None:
            return
        try:
            data = kernel.sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.retire(kernel)  # its exit is reaped and reported for a running cell
            return
        try:
            frames = kernel.reader.feed(data)
        except ValueError:
            frames = None
        if frames is None or any(h.get("op") != "cell_done" for h, _ in frames):
            self.retire(kernel)  # a kernel that speaks nonsense is treated as crashed
            return
        for header, _ in frames:
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

    def on_exit(self, pid, status, ru):
        if self.spare is not None and pid == self.spare[0]:
            self.drop_spare()  # a spare that died before being used
            return
        job = self.runs.pop(pid, None)
        if job is not None:
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
                self._kill_tree(kernel.pid, kernel.uid)
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


def probe_features(opts):
    """What this process may use; reported to the host in the ``ready`` frame."""
    abi = landlock_abi() if opts.get("landlock", True) else 0
    feats = {"landlock_abi": abi, "euid": os.geteuid(), "pid": os.getpid()}
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:  # can runs get their own pid namespace (and, in it, their own mounts)?
        os.close(err_r)
        code = 1
        try:
            if _libc.unshare(CLONE_NEWPID) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"unshare(CLONE_NEWPID): {os.strerror(err)}")
            code = 2
            inner = os.fork()
            if inner == 0:
                try:
                    if opts.get("private_mounts"):
                        private_run_mounts(opts, True)
                    os._exit(0)
                except BaseException as exc:
                    os.write(err_w, str(exc).encode()[:500])
                    os._exit(2)
            code = os.waitstatus_to_exitcode(os.waitpid(inner, 0)[1])
        except BaseException as exc:
            os.write(err_w, str(exc).encode()[:500])
        os._exit(code)
    os.close(err_w)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    problem = os.read(err_r, 1000).decode("utf-8", "replace")
    os.close(err_r)
    feats["pidns_ok"] = code in (0, 2)
    feats["mounts_ok"] = code == 0 and bool(opts.get("private_mounts"))
    if problem:
        feats["problem"] = problem
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                feats["vmsize_kb"] = int(line.split()[1])
    return feats


def warm_up():
    """Do once here what every run would otherwise do first after its fork: compile() builds
    CPython's ~120 AST heap types on first use (PyAST_Check), and run-time imports load once."""
    import atexit  # noqa: F401  (each is imported by every run or kernel)
    import fcntl  # noqa: F401
    import types  # noqa: F401
    exec(compile("pass", "<warm-up>", "exec"), {"__builtins__": __builtins__})
    capset_args()


def main():
    opts = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    if opts.get("stdio"):
        chan_in, chan_out = os.dup(0), os.dup(1)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
    else:
        chan_in = chan_out = int(opts.get("fd", 3))
        os.set_inheritable(chan_in, False)
    # Started with -S: site-packages are put on sys.path without running any .pth code, and
    # the interactive helpers site would add (exit, quit, ...) are installed by hand.
    sys.path.extend(p for p in opts.get("sys_path", []) if p not in sys.path)
    import _sitebuiltins
    import builtins
    builtins.exit = _sitebuiltins.Quitter("exit", "Ctrl-D (i.e. EOF)")
    builtins.quit = _sitebuiltins.Quitter("quit", "Ctrl-D (i.e. EOF)")
    builtins.help = _sitebuiltins._Helper()
    for name in opts.get("preload", []):
        try:
            __import__(name)
        except Exception:
            pass  # a missing optional module is not an error; the child gets ImportError
    chan = Channel(chan_in, chan_out)
    init = chan.read_head()  # the first frame carries the seccomp filter and the final options
    if not init:
        os._exit(0)
    header, size = init
    bpf = chan.read_payload_bytes(size)
    opts.update(header.get("opts", {}))
    opts["_seccomp_prog"] = seccomp_prepare(bpf) if bpf else None
    opts["_hard_limits"] = hard_limits()
    os.environ.clear()
    os.environ.update(opts.get("env", {}))
    try:
        exposed = prepare_zygote_mounts(opts)
        setup_error = None
    except OSError as exc:
        exposed, setup_error = [], str(exc)
        opts["private_mounts"] = False
    feats = probe_features(opts)
    feats["exposed"] = exposed
    if setup_error:
        feats["setup_error"] = setup_error
    opts["landlock_abi"] = min(feats["landlock_abi"], int(opts.get("landlock_max_abi", 99)))
    opts["_landlock"] = landlock_prepare(opts["landlock_abi"], opts.get("ro_paths", ["/"]),
                                         opts.get("dev_files", [])) \
        if opts["landlock_abi"] else None
    if opts.get("pidns") and not feats["pidns_ok"]:
        opts["pidns"] = False  # the host refuses to use us unless it asked for no pidns
    if not feats["mounts_ok"]:
        opts["private_mounts"] = False
    zyg = Zygote(chan, opts)
    feats["pidns"] = bool(opts.get("pidns"))
    feats["private_mounts"] = bool(opts.get("private_mounts"))
    zyg.send({"op": "ready", "features": feats})
    warm_up()
    import gc
    gc.collect()
    gc.freeze()  # long-lived objects out of the collector's way: children copy fewer pages
    zyg.serve()


if __name__ == "__main__":
    main()

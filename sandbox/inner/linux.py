"""Linux interfaces the zygote and its children call through libc: Landlock, seccomp,
capabilities and mounts (constants, prepared-once structures, thin wrappers that raise OSError).
"""

import ctypes
import errno
import os

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
#: Exit status of a child whose set-up failed (it never ran untrusted code).
SETUP_FAILED_EXIT = 126

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                        ctypes.c_ulong]
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


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


def landlock_restrict(prep, *workdirs):
    """Deny all filesystem access but the prepared rules plus everything below ``workdirs``;
    deny TCP bind/connect (ABI >= 4) and signals/abstract sockets leaving the domain (>= 6)."""
    syscall = _libc.syscall
    fd = syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(prep["attr"]), prep["size"],
                 prep["zero"])
    if fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        for path, rights in prep["rules"] + [(d, prep["fs_all"]) for d in workdirs]:
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


_CAP_ARGS: list = []  # (capset, header, data), built on first use


def capset_args():
    """capset's function and arguments, built once in the zygote (``warm_up``): building
    them in each run's pid 1 cost ~90 copied pages and 0.5 ms there."""
    if not _CAP_ARGS:
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
        _CAP_ARGS.extend((_libc.capset, header, (ctypes.c_uint32 * 6)()))
    return _CAP_ARGS


def drop_capabilities(bounding=True):
    """Clear every capability set and the bounding set (used when the uid stays 0).

    ``bounding=False`` leaves the bounding set, which only limits what an ``execve`` can gain:
    for a process that never execs (a run's pid 1) clearing the other sets is enough, and the
    64 prctl calls of the bounding set were ~3 % of a trivial run's CPU."""
    capset, header, data = capset_args()
    if bounding:
        prctl = _libc.prctl
        for cap in range(64):
            if prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
                break
    if capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


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

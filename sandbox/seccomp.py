"""The seccomp filter every sandboxed child loads, compiled once on the host with ``pyseccomp``.

The filter allows by default and answers EPERM to the calls a contained program never needs:
non-unix sockets (no TCP/UDP, not even on loopback), namespace and mount games, ptrace and
cross-process memory access, kernel module/BPF/keyring/perf interfaces and io_uring (whose
operations bypass seccomp). Syscalls from other ABIs (i386, x32) kill the process.
The children load the exported BPF bytes with one ``prctl`` (microseconds), so libseccomp is
needed only here, not inside the sandbox.
"""

from __future__ import annotations

import errno
import functools
import tempfile

#: Blocked outright (EPERM).
DENIED_SYSCALLS: tuple[str, ...] = (
    "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root",
    "chroot", "unshare", "setns", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "bpf", "perf_event_open", "keyctl", "add_key",
    "request_key", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "acct", "swapon", "swapoff", "reboot", "settimeofday", "clock_settime", "clock_adjtime",
    "adjtimex", "syslog", "quotactl", "open_by_handle_at", "name_to_handle_at", "vhangup",
    "iopl", "ioperm", "fanotify_init", "lookup_dcookie", "move_mount", "open_tree", "fsopen",
    "fsmount", "fsconfig", "fspick", "mount_setattr",
)
AF_UNIX = 1
#: clone() flags that create namespaces (CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET)
CLONE_NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 \
    | 0x20000000 | 0x40000000


@functools.lru_cache(maxsize=1)
def build_filter_bpf() -> bytes:
    """The compiled filter as raw ``struct sock_filter`` bytes; b"" when pyseccomp is missing."""
    try:
        import pyseccomp as sc
    except (ImportError, RuntimeError):
        return b""
    filt = sc.SyscallFilter(sc.ALLOW)
    deny = sc.ERRNO(errno.EPERM)
    filt.add_rule(deny, "socket", sc.Arg(0, sc.NE, AF_UNIX))
    for bit in range(32):  # one rule per namespace flag: (flags & bit) == bit -> EPERM
        flag = 1 << bit
        if CLONE_NAMESPACE_FLAGS & flag:
            filt.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    # clone3 takes its flags in memory seccomp cannot read: ENOSYS makes libc fall back to clone.
    filt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for name in DENIED_SYSCALLS:
        try:
            filt.add_rule(deny, name)
        except (OSError, ValueError, RuntimeError):
            continue  # not a syscall on this architecture
    with tempfile.TemporaryFile() as fh:
        filt.export_bpf(fh)
        fh.seek(0)
        return fh.read()

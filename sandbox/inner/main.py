"""Entry point of the in-sandbox runtime: read the init frame, prepare mounts, Landlock and
seccomp once, probe what the kernel allows, report ``ready`` and serve.
"""

import builtins
import ctypes
import json
import os
import sys

from .child import hard_limits
from .linux import (
    CLONE_NEWPID,
    _libc,
    capset_args,
    landlock_abi,
    landlock_prepare,
    prepare_zygote_mounts,
    private_run_mounts,
    seccomp_prepare,
)
from .payload import Channel
from .zygote import Zygote


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


def nested_ro_paths(opts):
    """The read-only rules of a forked interpreter's layer: those of every child, with "/"
    replaced by its entries other than the one holding the sandbox's root directory."""
    ro = list(opts.get("ro_paths", ["/"]))
    if "/" not in ro:
        return ro
    run_dir = opts.get("run_dir") or ""
    top = "/" + run_dir.strip("/").split("/")[0] if run_dir else None
    entries = ["/" + e for e in sorted(os.listdir("/"))]
    return [p for p in ro if p != "/"] + [p for p in entries if p != top]


def warm_up():
    """Do once here what every run would otherwise do first after its fork: compile() builds
    CPython's ~120 AST heap types on first use (PyAST_Check), and run-time imports load once."""
    import atexit  # noqa: F401  (each is imported by every run or kernel)
    import fcntl  # noqa: F401
    import types  # noqa: F401
    exec(compile("pass", "<warm-up>", "exec"), {"__builtins__": builtins})
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
    # A forked interpreter's own layer: read-only as above but nothing of the sandbox's root
    # (other sessions' and the family's workspaces), plus its own workspace and nursery.
    opts["_landlock_nested"] = landlock_prepare(opts["landlock_abi"],
                                                nested_ro_paths(opts),
                                                opts.get("dev_files", [])) \
        if opts["landlock_abi"] else None
    if opts.get("pidns") and not feats["pidns_ok"]:
        opts["pidns"] = False  # the host refuses to use us unless it asked for no pidns
    if not feats["mounts_ok"]:
        opts["private_mounts"] = False
    zyg = Zygote(chan, opts)
    feats["pidns"] = bool(opts.get("pidns"))
    feats["private_mounts"] = bool(opts.get("private_mounts"))
    # session fork: sibling Landlock domains need signal scoping (ABI 6) to be separate
    feats["fork"] = bool(opts.get("pidns") and opts.get("private_mounts")
                         and opts["landlock_abi"] >= 6)
    zyg.send({"op": "ready", "features": feats})
    warm_up()
    import gc
    gc.collect()
    gc.freeze()  # long-lived objects out of the collector's way: children copy fewer pages
    zyg.serve()


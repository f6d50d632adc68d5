"""Finding and killing processes: children through /proc, subtree sweeps bounded in time,
reaping (exit statuses of tracked pids are parked for the main loop), fd hygiene after fork.
"""

import os
import signal
import time


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


_STRAY_EXITS: dict = {}  # pid -> (status, rusage) reaped before its waiter asked


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


def _close_all_but(keep):
    """Close every fd >= 3 except ``keep`` (a few close_range calls over the gaps)."""
    low = 3
    for fd in sorted(set(keep)):
        if fd >= low:
            if fd > low:
                os.closerange(low, fd)
            low = fd + 1
    _close_fds_from(low)

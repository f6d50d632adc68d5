"""What the zygote tracks: a ``Job`` per run or cell it waits for, a ``Kernel`` per live
persistent interpreter."""

import time

from .framing import FrameReader

#: Largest frame a kernel may send back (its replies are small headers).
MAX_CHILD_FRAME = 1 << 20


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
        self.proc = None  # the interpreter's pid here (told by its socket's credentials)
        self.family = None  # a Family once the session was forked
        self.shared_uid = False  # other sessions run with our uid: never kill by uid


class Family:
    """The interpreters of a forked session, all children of one holder in one pid namespace
    whose pid 1 (``init``) is our child: killed only when its last member goes."""

    def __init__(self, root):
        self.init = root.pid
        self.uid = root.uid
        self.members = {root.session}

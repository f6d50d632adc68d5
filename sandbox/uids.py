"""Per-run uids: a private block of unprivileged uids for one sandbox (root hosts only).

Each run gets a uid nobody else uses, so RLIMIT_NPROC (counted per uid) bounds a fork bomb
without touching other runs, files of one run are unreadable to the others, and the zygote can
find every process a run left behind by its uid. Blocks are drawn at random above 2**31 and
claimed with an flock'ed file, so concurrent sandboxes (other processes too) never share one.
"""

from __future__ import annotations

import fcntl
import os
import random
import tempfile

from palaestra.errors import SandboxError

BLOCK = 4096
LOW = 2**31
HIGH = 2**32 - 4 * BLOCK


class UidRange:
    """A claimed block of ``BLOCK`` uids; ``acquire``/``release`` hand them out."""

    def __init__(self, lock_dir: str | None = None) -> None:
        self.lock_dir = lock_dir or os.path.join(tempfile.gettempdir(), "palaestra-sandbox-uids")
        os.makedirs(self.lock_dir, mode=0o700, exist_ok=True)
        rng = random.SystemRandom()
        self._fd = -1
        self._path = ""
        for _ in range(64):
            base = rng.randrange(LOW // BLOCK, HIGH // BLOCK) * BLOCK
            path = os.path.join(self.lock_dir, f"{base}.lock")
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            self._fd, self._path, self.base = fd, path, base
            break
        else:
            raise SandboxError("could not claim a block of sandbox uids; remove stale files in "
                               f"{self.lock_dir}")
        self._free = list(range(self.base + BLOCK - 1, self.base, -1))

    def acquire(self) -> int:
        if not self._free:
            raise SandboxError(f"more than {BLOCK - 1} runs/sessions at once in one sandbox; "
                               "close sessions or lower max_concurrency")
        return self._free.pop()

    def release(self, uid: int) -> None:
        self._free.append(uid)

    def release_range(self) -> None:
        if self._fd >= 0:
            try:
                os.unlink(self._path)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = -1

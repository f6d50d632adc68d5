"""terminate_process_group stops a launched server and its children, also one ignoring SIGTERM."""

import os
import subprocess
import sys
import time

from palaestra.processes import terminate_process_group

# a parent that ignores SIGTERM and a child of its own: both must be gone afterwards
SCRIPT = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie waiting for its reaper counts as gone
        return stat.read().split()[2] != "Z"


def test_the_whole_group_goes_even_when_sigterm_is_ignored():
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    child = int(proc.stdout.readline())
    terminate_process_group(proc, grace_s=0.5)
    assert proc.returncode == -9  # SIGTERM ignored, so SIGKILL after the grace
    for _ in range(50):
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child)
    terminate_process_group(proc)  # idempotent

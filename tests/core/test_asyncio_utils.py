"""`in_daemon_thread`: results and exceptions come back to the caller; the thread is a daemon."""

from __future__ import annotations

import asyncio
import threading

import pytest

from palaestra.asyncio_utils import in_daemon_thread


async def test_result_exception_and_daemon_thread() -> None:
    seen: list[threading.Thread] = []

    def work(x: int, *, y: int) -> int:
        seen.append(threading.current_thread())
        return x + y

    assert await in_daemon_thread(work, 2, y=3) == 5
    assert seen[0] is not threading.main_thread() and seen[0].daemon

    def fail() -> None:
        raise ValueError("from the thread")

    with pytest.raises(ValueError, match="from the thread"):
        await in_daemon_thread(fail)


async def test_the_loop_keeps_running_while_the_call_blocks() -> None:
    release = threading.Event()
    call = asyncio.ensure_future(in_daemon_thread(release.wait, 5.0))
    await asyncio.sleep(0.05)
    assert not call.done()  # blocked in its thread, not in the event loop
    release.set()
    assert await call is True


def test_wait_for_stop_signal_returns_on_sigterm() -> None:
    import signal
    import subprocess
    import sys
    import time

    code = ("import asyncio, sys\n"
            "from palaestra.asyncio_utils import wait_for_stop_signal\n"
            "async def main():\n"
            "    print('ready', flush=True)\n"
            "    await wait_for_stop_signal()\n"
            "    print('stopped', flush=True)\n"
            "asyncio.run(main())\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)  # the handlers are installed right after the print
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out.strip() == "stopped"

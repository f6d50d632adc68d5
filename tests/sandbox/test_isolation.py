"""Runs and sessions cannot see or starve each other (issue 18), and no launcher is silently
weaker (issue 17): each run is an unprivileged uid in its own pid namespace, with its own /proc
and its own size-limited workspace, under bubblewrap and under ``unshare`` alike.

Every test starts real sandboxes, once with the launcher chosen by default (bubblewrap when it
works here) and once forced onto ``unshare`` (``use_bwrap=False``).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid

import pytest
import pytest_asyncio
from sandbox_testutil import host_processes_matching

from palaestra.sandbox import Sandbox, SandboxFileError
from palaestra.sandbox.probe import probe_isolation

pytestmark = pytest.mark.asyncio(loop_scope="module")

QUOTA_MB = 16
#: what a run sees of processes: its own pids, its parent, and every cmdline it can read
PROC_VIEW = """
import json, os
pids, cmdlines = [], []
for entry in os.listdir("/proc"):
    if entry.isdigit():
        pids.append(int(entry))
        try:
            cmdlines.append(open(f"/proc/{entry}/cmdline", "rb").read().decode("latin-1"))
        except OSError:
            pass
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "uid": os.getuid(),
                  "pids": sorted(pids), "cmdlines": cmdlines}))
"""
#: writes 1 MiB chunks until the workspace is full; prints how many fit and the error
FILL = """
import errno, os
n = 0
try:
    while n < 4096:
        with open(f"fill{n}", "wb") as fh:
            fh.write(b"x" * 2**20)
        n += 1
    print(n, "no-error")
except OSError as e:
    print(n, errno.errorcode[e.errno])
"""


def _launchers() -> list:
    unshare_ok = probe_isolation().unshare is not None
    return ["default", pytest.param("unshare", marks=pytest.mark.skipif(
        not unshare_ok, reason="unshare cannot create namespaces here"))]


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=_launchers())
async def sb(request: pytest.FixtureRequest):
    # One worker: every run below is handled by the same zygote, the case issue 18 describes.
    kwargs = {"use_bwrap": False} if request.param == "unshare" else {}
    async with Sandbox(workers=1, workspace_mb=QUOTA_MB, max_concurrency=8, **kwargs) as box:
        yield box


async def test_every_launcher_gives_uid_pidns_and_quotas(sb: Sandbox) -> None:
    mode = sb.mode  # type: ignore[attr-defined]
    assert mode["per_run_pidns"] and mode["private_proc"]
    assert mode["workspace_quota_mb"] == QUOTA_MB
    assert mode["per_run_uid"] == (os.geteuid() == 0)
    res = await sb.run(PROC_VIEW)
    assert res.ok, res
    view = json.loads(res.stdout)
    # never pid 1 itself (signals behave); its parent is the namespace's pid 1 or, on the
    # one-fork path, the zygote outside the namespace (ppid 0)
    assert view["pid"] == 2 and view["ppid"] in (0, 1)
    if os.geteuid() == 0:
        assert view["uid"] != 0


async def test_a_run_cannot_see_a_concurrent_runs_processes(sb: Sandbox) -> None:
    secret = f"argv-secret-{uuid.uuid4().hex}"
    holder = asyncio.ensure_future(sb.run(
        "import subprocess, sys\n"
        f"subprocess.run([sys.executable, '-c', 'import time; time.sleep(20)', {secret!r}])",
        timeout=30))
    try:
        deadline = time.monotonic() + 10
        while not host_processes_matching(secret) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert host_processes_matching(secret), "the holder run did not start its process"
        res = await sb.run(PROC_VIEW)  # same sandbox, same (single) worker, concurrently
        assert res.ok, res
        view = json.loads(res.stdout)
        assert not any(secret in c for c in view["cmdlines"])
        assert set(view["pids"]) <= {1, view["pid"]}  # only itself (and its own pid 1)
        async with sb.session() as s:  # a session's runs are no different
            res = await s.run(PROC_VIEW)
            assert res.ok and secret not in res.stdout
            assert set(json.loads(res.stdout)["pids"]) <= {1, 2}
    finally:
        holder.cancel()
        with pytest.raises(asyncio.CancelledError):
            await holder
    deadline = time.monotonic() + 5
    while host_processes_matching(secret) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert host_processes_matching(secret) == []


async def test_a_full_session_does_not_starve_other_sessions_or_runs(sb: Sandbox) -> None:
    async with sb.session() as hog, sb.session() as other:
        res = await hog.run(FILL, timeout=30)
        assert res.ok, res
        n, err = res.stdout.split()
        assert err == "ENOSPC" and QUOTA_MB - 2 <= int(n) <= QUOTA_MB  # its own quota, full
        still_full = await hog.run("open('more', 'wb').write(b'x' * 2**20)")
        assert not still_full.ok and "No space left" in still_full.stderr
        write_half = ("open('half', 'wb').write(b'x' * (QUOTA_MB // 2) * 2**20)\n"
                      "print('ok')").replace("QUOTA_MB", str(QUOTA_MB))
        other_res, run_res = await asyncio.gather(other.run(write_half), sb.run(write_half))
        assert other_res.ok and other_res.stdout == "ok\n", other_res
        assert run_res.ok and run_res.stdout == "ok\n", run_res  # e.g. a grading run
        assert await hog.read_file("fill0") == b"x" * 2**20  # the full session keeps its files
        with pytest.raises(SandboxFileError, match="No space left"):
            await hog.write_file("note.txt", "more")


async def test_concurrent_stateless_runs_each_get_their_own_quota(sb: Sandbox) -> None:
    hog, other = await asyncio.gather(
        sb.run(FILL, timeout=30),
        sb.run("import time\ntime.sleep(0.5)\nopen('f', 'wb').write(b'x' * 8 * 2**20)\n"
               "print('ok')", timeout=30))
    assert hog.ok and hog.stdout.split()[1] == "ENOSPC", hog
    assert other.ok and other.stdout == "ok\n", other


async def test_signals_and_exit_codes_are_reported(sb: Sandbox) -> None:
    res = await sb.run("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)")
    assert res.exit_code == 143 and res.signal == 15 and not res.ok
    res = await sb.run("import os, signal\nos.kill(os.getpid(), signal.SIGINT)")
    assert res.exit_code != 0
    res = await sb.run_command(["sh", "-c", "kill -TERM $$"])
    assert res.exit_code == 143
    res = await sb.run("import os\nos._exit(7)")
    assert res.exit_code == 7
    # the parent is either another uid/Landlock domain (EPERM) or outside the run's pid
    # namespace altogether (ppid 0: no pid to signal)
    code = ("import os, signal\nfor pid in (os.getppid(), 1):\n"
            "    if pid == 0:\n        print('no parent'); continue\n"
            "    try:\n        os.kill(pid, signal.SIGKILL); print('killed')\n"
            "    except OSError as e:\n        print(e.errno)\n")
    res = await sb.run(code)
    assert res.stdout in ("1\n1\n", "no parent\n1\n"), res  # EPERM


_NO_SYS_ADMIN = """
import asyncio, sys
from palaestra.sandbox import IsolationUnavailableError, Sandbox
async def main():
    try:
        async with Sandbox(use_bwrap=False, allow_network_isolation_fallback=True) as sb:
            print("STARTED", sb.mode)
    except IsolationUnavailableError as exc:
        print("REFUSED", exc)
asyncio.run(main())
"""


async def test_refuses_to_start_where_runs_cannot_get_namespaces() -> None:
    """A root host without CAP_SYS_ADMIN (a locked-down container): no namespace can be made,
    and the sandbox says so and how to fix it instead of running weaker."""
    if os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv"):
        pytest.skip("needs root and setpriv to drop CAP_SYS_ADMIN")
    out = await asyncio.to_thread(
        subprocess.run, ["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin",
                         sys.executable, "-c", _NO_SYS_ADMIN],
        capture_output=True, text=True, timeout=120)
    assert "REFUSED" in out.stdout, out.stdout + out.stderr
    assert "pid and mount namespaces" in out.stdout and "apt-get install bubblewrap" in out.stdout

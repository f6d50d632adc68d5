"""Adversarial programs against both backends: each is contained, the host is unchanged, and the
next run in the same sandbox is clean.

Cases (issue 3): infinite loop, fork bomb, memory bomb, 10 GB file, writes outside the
workspace, host secrets, sockets (loopback and outside), killing the parent, a daemon that
outlives the run, huge stdout, non-UTF-8 output, reading stdin when none is given.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import pytest_asyncio
from sandbox_testutil import (
    HOST_SECRET,
    host_processes_matching,
    planted_secrets,
    processes_with_uid_in,
    requires_docker,
)

from palaestra.sandbox import ExecResult, Sandbox
from palaestra.sandbox.probe import probe_isolation

pytestmark = pytest.mark.asyncio(loop_scope="module")

REPO_ROOT = Path(__file__).resolve().parents[2]
CLEAN_PROBE = """
import json, os
print(json.dumps({"files": sorted(os.listdir(".")),
                  "secret": os.environ.get("PALAESTRA_TEST_SECRET"),
                  "home": os.environ.get("HOME") == os.getcwd()}))
"""


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=[
    "local", pytest.param("local-unshare", marks=pytest.mark.skipif(
        probe_isolation().unshare is None, reason="unshare cannot create namespaces here")),
    pytest.param("docker", marks=[pytest.mark.docker, requires_docker()])])
async def sb(request: pytest.FixtureRequest):
    # local-unshare: the fallback launcher, forced even where bubblewrap is installed
    kwargs = {"backend": "local", "use_bwrap": False} if request.param == "local-unshare" \
        else {"backend": request.param}
    with planted_secrets():  # in the host environment for the whole module
        async with Sandbox(memory_mb=256, max_processes=48, **kwargs) as box:
            yield box


async def assert_clean(box: Sandbox) -> None:
    """The next run sees an empty fresh workspace, and the host holds no leftovers."""
    res = await box.run(CLEAN_PROBE, timeout=10)
    assert res.ok, res
    assert json.loads(res.stdout) == {"files": [], "secret": None, "home": True}
    if box.backend_name == "local" and getattr(box, "_uids", None) is not None:
        lo = box._uids.base  # type: ignore[attr-defined]
        deadline = time.monotonic() + 5
        while processes_with_uid_in(lo, lo + 4096) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert processes_with_uid_in(lo, lo + 4096) == []
    if box.backend_name == "docker":
        import docker

        client = docker.from_env()
        owner = f"{socket.gethostname()}:{os.getpid()}"
        deadline = time.monotonic() + 20
        while True:
            live = client.containers.list(sparse=True,
                                          filters={"label": f"palaestra.sandbox.owner={owner}"})
            if len(live) <= box.config.docker_pool_size or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        client.close()
        assert len(live) <= box.config.docker_pool_size  # used containers were discarded


async def test_infinite_loop_times_out(sb: Sandbox) -> None:
    t0 = time.monotonic()
    res = await sb.run("while True:\n    pass\n", timeout=1.0)
    assert res.timed_out and res.exit_code == 137 and not res.oom_killed and res.error is None
    assert 0.9 <= res.duration_s and time.monotonic() - t0 < 10
    await assert_clean(sb)


async def test_fork_bomb_is_bounded_and_killed(sb: Sandbox) -> None:
    code = ("import os\nwhile True:\n    try:\n        os.fork()\n"
            "    except OSError:\n        pass\n")
    res = await sb.run(code, timeout=1.5)
    assert res.timed_out and res.exit_code == 137 and res.error is None
    # the host can still start processes
    assert subprocess.run(["true"]).returncode == 0
    await assert_clean(sb)


async def test_memory_bomb_is_oom_killed(sb: Sandbox) -> None:
    res = await sb.run("x = bytearray(8 * 1024 ** 3)\nprint('allocated')", timeout=10)
    assert res.oom_killed and res.exit_code == 137 and not res.timed_out
    assert "MemoryError" in res.stderr and "allocated" not in res.stdout
    res = await sb.run("chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 2**20))",
                       timeout=20)
    assert res.oom_killed and res.exit_code == 137 and not res.timed_out
    await assert_clean(sb)


async def test_ten_gb_file_hits_the_file_size_limit(sb: Sandbox) -> None:
    limit = sb.config.max_file_size_mb * 2**20
    code = ("import os\nf = open('big', 'wb')\ntry:\n"
            "    for _ in range(10 * 1024):\n        f.write(b'\\0' * 2**20)\n"
            "except OSError as e:\n    print('ERR', e.errno, os.path.getsize('big'))\n")
    res = await sb.run(code, timeout=20)
    assert res.ok, res
    tag, errno_, size = res.stdout.split()
    assert (tag, int(errno_)) == ("ERR", 27) and int(size) <= limit  # EFBIG
    # a shell tool gets SIGXFSZ (128 + 25) instead
    res = await sb.run_command(["sh", "-c", "head -c 10G /dev/zero > big"], timeout=20)
    assert res.exit_code == 153 and not res.timed_out
    await assert_clean(sb)


async def test_writes_outside_the_workspace_are_refused(sb: Sandbox) -> None:
    tag = uuid.uuid4().hex[:8]
    targets = [f"{os.path.expanduser('~')}/escape-{tag}", f"/tmp/escape-{tag}",
               f"{REPO_ROOT}/escape-{tag}", f"/etc/escape-{tag}", f"/escape-{tag}"]
    code = f"""
import os
results = {{}}
for path in {targets!r}:
    try:
        with open(path, "w") as fh:
            fh.write("x")
        results[path] = "written"
    except OSError as e:
        results[path] = "blocked"
try:
    os.symlink({targets[1]!r}, "link")
    open("link", "w").write("x")
    results["symlink"] = "written"
except OSError:
    results["symlink"] = "blocked"
import json; print(json.dumps(results))
"""
    res = await sb.run(code, timeout=10)
    assert res.ok, res
    results = json.loads(res.stdout)
    assert set(results.values()) == {"blocked"}, results
    for path in targets:  # and nothing appeared on the host
        assert not os.path.exists(path)
    await assert_clean(sb)


async def test_host_secrets_are_invisible(sb: Sandbox) -> None:
    secret_file = Path(f"/tmp/palaestra-secret-{uuid.uuid4().hex[:8]}")
    secret_file.write_text(HOST_SECRET)
    try:
        code = f"""
import os
seen = [k for k, v in os.environ.items() if {HOST_SECRET!r} in v]
print("env", seen, os.environ["HOME"] == os.getcwd())
for path in ["/proc/self/environ", "/proc/1/environ", {str(secret_file)!r}]:
    try:
        print(path, {HOST_SECRET!r} in open(path, errors="replace").read())
    except OSError as e:
        print(path, "blocked")
"""
        res = await sb.run(code, timeout=10)
    finally:
        secret_file.unlink()
    assert res.ok, res
    assert HOST_SECRET not in res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "env [] True"
    assert lines[1] == "/proc/self/environ False"
    assert lines[2].endswith(("blocked", "False")) and lines[3].endswith("blocked")
    await assert_clean(sb)


async def test_sockets_loopback_and_outside_are_blocked(sb: Sandbox) -> None:
    accepted: list[int] = []

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.setblocking(False)
    udp_port = udp.getsockname()[1]
    code = f"""
import socket
TCP, UDP, V4, V6 = socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.AF_INET, socket.AF_INET6
for name, fam, kind, addr in [("tcp-loopback", V4, TCP, ("127.0.0.1", {port})),
                              ("tcp-outside", V4, TCP, ("1.1.1.1", 80)),
                              ("tcp6", V6, TCP, ("::1", {port})),
                              ("udp-loopback", V4, UDP, ("127.0.0.1", {udp_port}))]:
    try:
        s = socket.socket(fam, kind)
        s.settimeout(2)
        s.connect(addr)
        s.send(b"hello")
        print(name, "OPEN")
    except OSError as e:
        print(name, "blocked", e.errno)
"""
    try:
        res = await sb.run(code, timeout=15)
        await asyncio.sleep(0.2)
        try:
            got_udp = udp.recv(100)
        except BlockingIOError:
            got_udp = b""
    finally:
        server.close()
        await server.wait_closed()
        udp.close()
    assert res.ok, res
    assert "OPEN" not in res.stdout and res.stdout.count("blocked") == 4, res.stdout
    assert accepted == [] and got_udp == b""
    await assert_clean(sb)


async def test_killing_the_parent_fails(sb: Sandbox) -> None:
    # ppid 0: the run's parent (the zygote) is outside the run's pid namespace, so it has no
    # pid there to signal (kill(0) would be the run's own process group)
    code = """
import os, signal
ppid = os.getppid()
print("ppid", ppid)
for pid in ([ppid] if ppid else []) + [1]:
    try:
        os.kill(pid, signal.SIGKILL)
        print(pid, "killed")
    except OSError as e:
        print(pid, "blocked", e.errno)
"""
    res = await sb.run(code, timeout=10)
    assert res.ok, res
    has_parent = not res.stdout.startswith("ppid 0\n")
    assert "killed" not in res.stdout
    assert res.stdout.count("blocked 1") == (2 if has_parent else 1), res.stdout  # EPERM
    await assert_clean(sb)
    if sb.backend_name == "local":
        assert all(w is not None and not w.closed for w in sb._workers)  # type: ignore[attr-defined]


async def test_daemon_does_not_outlive_the_run(sb: Sandbox) -> None:
    marker = f"{int(time.time()) % 100000}.{uuid.uuid4().int % 10**6}"
    code = f"""
import os, subprocess, time
subprocess.Popen(["sleep", "1{marker}"], start_new_session=True, stdin=subprocess.DEVNULL,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
if os.fork() == 0:          # classic double-fork daemon
    os.setsid()
    if os.fork() == 0:
        os.execvp("sleep", ["sleep", "2{marker}"])
    os._exit(0)
time.sleep(0.2)
print("spawned")
"""
    res = await sb.run(code, timeout=10)
    assert res.ok and res.stdout == "spawned\n", res
    deadline = time.monotonic() + 5
    while host_processes_matching(marker) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert host_processes_matching(marker) == []
    await assert_clean(sb)


async def test_huge_stdout_is_capped_with_a_marker(sb: Sandbox) -> None:
    cap = sb.config.max_output_bytes
    res = await sb.run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", timeout=20)
    assert res.truncated and not res.timed_out and res.exit_code != 0
    body, _, tail = res.stdout.partition("\n[palaestra: output truncated")
    assert len(body) == cap and set(body) == {"x"} and "bytes omitted]" in tail
    await assert_clean(sb)


async def test_binary_output_is_decoded_with_replacement(sb: Sandbox) -> None:
    code = ("import sys\nsys.stdout.buffer.write(b'ok:' + bytes(range(256)))\n"
            "sys.stderr.buffer.write(b'\\xff\\xfe\\x00end')\n")
    res = await sb.run(code, timeout=10)
    assert res.ok, res
    assert res.stdout.startswith("ok:\x00\x01") and "\ufffd" in res.stdout
    assert res.stderr == "\ufffd\ufffd\x00end"
    await assert_clean(sb)


async def test_reading_stdin_when_none_is_given_gets_eof(sb: Sandbox) -> None:
    res = await sb.run("import sys\nprint(repr(sys.stdin.read()))\ninput()", timeout=10)
    assert not res.timed_out and res.exit_code == 1
    assert res.stdout == "''\n" and "EOFError" in res.stderr
    assert res.duration_s < 5
    await assert_clean(sb)


async def test_results_are_exec_results(sb: Sandbox) -> None:
    res = await sb.run("print('fine')")
    assert isinstance(res, ExecResult) and res.ok and res.stdout == "fine\n"

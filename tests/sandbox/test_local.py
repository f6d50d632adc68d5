"""LocalSandbox features with real processes: runs, files, stdin, sessions, the persistent
interpreter, concurrency, crash recovery and cancellation."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import pytest
import pytest_asyncio
from sandbox_testutil import host_processes_matching, processes_with_uid_in

from palaestra.sandbox import ExecResult, Sandbox, SandboxError, SandboxFileError
from palaestra.sandbox.probe import probe_isolation

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=[
    "default", pytest.param("unshare", marks=pytest.mark.skipif(
        probe_isolation().unshare is None, reason="unshare cannot create namespaces here"))])
async def sb(request: pytest.FixtureRequest):
    # "unshare": the fallback launcher, forced even where bubblewrap is installed
    kwargs = {"use_bwrap": False} if request.param == "unshare" else {}
    async with Sandbox(env={"EXTRA_VAR": "given"}, max_output_bytes=4096, **kwargs) as box:
        yield box


async def test_python_run_basics(sb: Sandbox) -> None:
    res = await sb.run("import os\nprint('hi', os.environ['EXTRA_VAR'])\n")
    assert res.ok and res.stdout == "hi given\n" and res.stderr == ""
    assert res.duration_s > 0 and res.cpu_s is not None
    res = await sb.run("import sys\nprint('x')\nsys.exit(3)")
    assert res.exit_code == 3 and res.stdout == "x\n" and not res.ok
    res = await sb.run("1 / 0")
    assert res.exit_code == 1 and "ZeroDivisionError" in res.stderr
    assert 'File "<string>", line 1' in res.stderr and "exec_python" not in res.stderr
    res = await sb.run("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)")
    assert res.exit_code == 128 + signal.SIGTERM and res.signal == signal.SIGTERM
    assert not res.oom_killed and not res.timed_out
    res = await sb.run("if __name__ == '__main__':\n    print(__name__)")
    assert res.stdout == "__main__\n"


async def test_files_and_stdin(sb: Sandbox) -> None:
    files = {"helper.py": "def twice(x):\n    return 2 * x\n", "data/in.txt": b"21"}
    code = "import helper\nprint(helper.twice(int(open('data/in.txt').read())), input())"
    res = await sb.run(code, stdin="from-stdin\n", files=files)
    assert res.ok and res.stdout == "42 from-stdin\n", res
    res = await sb.run("cat data/in.txt; read x; echo \" $x\"", language="bash",
                       stdin=b"piped", files=files)
    assert res.ok and res.stdout == "21 piped\n", res
    res = await sb.run_command(["sh", "-c", "ls; exit 4"], files={"a.txt": b""})
    assert res.exit_code == 4 and res.stdout == "a.txt\n"
    res = await sb.run_command(["no-such-binary-xyz"])
    assert res.exit_code == 127 and "No such file" in res.stderr


async def test_each_run_gets_a_fresh_directory(sb: Sandbox) -> None:
    first = await sb.run("import os\nopen('left-behind', 'w').write('x')\nprint(os.listdir('.'))")
    second = await sb.run("import os\nprint(os.listdir('.'), os.access('.', os.W_OK))")
    assert first.ok and second.ok
    assert first.stdout == "['left-behind']\n"
    assert second.stdout == "[] True\n"  # nothing of the first run is left, and it may write
    both = await asyncio.gather(*(sb.run("import os, time\nopen('mine', 'w').write(str(os.getpid()))"
                                         "\ntime.sleep(0.3)\nprint(os.listdir('.'))")
                                  for _ in range(2)))
    assert [r.stdout for r in both] == ["['mine']\n"] * 2  # concurrent runs: one each


async def test_stderr_is_capped_too(sb: Sandbox) -> None:
    res = await sb.run("import sys\nsys.stderr.write('e' * 100000)\nprint('done')")
    assert res.ok and res.truncated and res.stdout == "done\n"
    assert res.stderr.startswith("e" * 4096) and "95904 of 100000 bytes omitted" in res.stderr


async def test_concurrent_runs_do_not_mix(sb: Sandbox) -> None:
    async def one(i: int) -> ExecResult:
        return await sb.run(f"import time\ntime.sleep(0.01)\nprint({i} * {i})",
                            files={"n.txt": str(i)})

    results = await asyncio.gather(*(one(i) for i in range(24)))
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(24)]


async def test_session_keeps_its_directory(sb: Sandbox) -> None:
    async with sb.session() as s:
        await s.write_file("notes/a.txt", "hello")
        res = await s.run_command(["cat", "notes/a.txt"])
        assert res.ok and res.stdout == "hello"
        res = await s.run("open('b.txt', 'w').write('from python')")
        assert res.ok
        assert await s.read_file("b.txt") == b"from python"
        res = await s.run("import os\nprint(sorted(os.listdir('.')))", language="python")
        assert res.stdout == "['b.txt', 'notes']\n"
        with pytest.raises(SandboxFileError, match="missing"):
            await s.read_file("missing")
        with pytest.raises(SandboxError, match="relative path"):
            await s.write_file("../escape", b"x")
        workdir = s.workdir
        res = await s.run("import os\nprint(os.getcwd())")
        assert res.stdout == f"{workdir}\n"
    gone = await sb.run(f"import os\nprint(os.path.exists({workdir!r}))")
    assert gone.stdout == "False\n"  # closing the session deleted its directory
    with pytest.raises(SandboxError, match="closed"):
        await s.run("print(1)")


async def test_session_file_io_never_follows_symlinks(sb: Sandbox, tmp_path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    async with sb.session() as s:
        # the agent plants symlinks pointing outside its workspace
        res = await s.run(f"import os\nos.symlink({str(victim)!r}, 'evil')\n"
                          f"os.symlink({str(tmp_path)!r}, 'evildir')")
        assert res.ok, res
        with pytest.raises(SandboxFileError):
            await s.read_file("evil")
        with pytest.raises(SandboxFileError):
            await s.write_file("evil", b"pwned")
        with pytest.raises(SandboxFileError):
            await s.write_file("evildir/new.txt", b"pwned")
        res = await s.run("import os\nos.mkfifo('fifo')")
        assert res.ok
        with pytest.raises(SandboxFileError, match="regular file"):
            await s.read_file("fifo")  # and it does not block on the FIFO
    assert victim.read_text() == "original" and not (tmp_path / "new.txt").exists()


async def test_persistent_python_keeps_variables(sb: Sandbox) -> None:
    marker = f"77{uuid.uuid4().int % 10**6}.5"
    async with sb.session(persistent_python=True) as s:
        assert (await s.run("x = 41\nimport math")).ok
        res = await s.run("print(x + 1, math.pi > 3)")
        assert res.stdout == "42 True\n"
        res = await s.run("exit(3)")  # SystemExit ends the cell, not the interpreter
        assert res.exit_code == 3
        assert (await s.run("print(x)")).stdout == "41\n"
        res = await s.run("print(input())", stdin="typed")
        assert res.stdout == "typed\n"
        res = await s.run(f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'], "
                          "start_new_session=True)\nprint('spawned')")
        assert res.ok
        deadline = time.monotonic() + 5
        while host_processes_matching(marker) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert host_processes_matching(marker) == []  # nothing outlives a cell
        assert (await s.run("print(x)")).stdout == "41\n"  # ... except the interpreter
        res = await s.run("while True:\n    pass", timeout=1.0)
        assert res.timed_out and res.exit_code == 137
        res = await s.run("print(x)")
        assert "interpreter was restarted" in res.stderr and "NameError" in res.stderr
        assert (await s.run("y = 1")).ok
        res = await s.run("big = bytearray(16 * 1024 ** 3)")
        assert res.oom_killed and res.exit_code == 137
        res = await s.run("print('fresh')")
        assert res.stdout == "fresh\n" and "restarted" in res.stderr
        await s.write_file("data.txt", "kept")
        res = await s.run("print(open('data.txt').read())")
        assert res.stdout == "kept\n"


async def test_stateful_sandbox_is_one_session() -> None:
    async with Sandbox(stateful=True, persistent_python=True) as st:
        await st.run("z = 5")
        assert (await st.run("print(z * 2)")).stdout == "10\n"
        await st.write_file("q.txt", "qq")
        assert await st.read_file("q.txt") == b"qq"
        assert (await st.run_command(["cat", "q.txt"])).stdout == "qq"


async def test_worker_crash_gives_an_error_result_then_recovers(sb: Sandbox) -> None:
    worker = sb._workers[0]  # type: ignore[attr-defined]
    task = asyncio.ensure_future(sb.run("import time\ntime.sleep(30)", timeout=60))
    await asyncio.sleep(0.5)
    os.killpg(worker._proc.pid, signal.SIGKILL)  # the whole worker dies mid-run
    res = await asyncio.wait_for(task, 20)
    assert isinstance(res, ExecResult) and res.error and res.exit_code == -1
    assert worker.closed
    results = await asyncio.gather(*(sb.run("print('back')") for _ in range(6)))
    assert all(r.ok and r.stdout == "back\n" for r in results)
    await asyncio.sleep(0)
    fresh = await sb._worker(0)  # type: ignore[attr-defined]
    assert fresh is not worker and not fresh.closed


async def test_cancelled_run_leaves_nothing_behind(sb: Sandbox) -> None:
    marker = f"88{uuid.uuid4().int % 10**6}.5"
    task = asyncio.ensure_future(sb.run_command(["sleep", marker], timeout=60))
    deadline = time.monotonic() + 10
    while not host_processes_matching(marker) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert host_processes_matching(marker)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 5
    while host_processes_matching(marker) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert host_processes_matching(marker) == []
    assert (await sb.run("print(1)")).ok


async def test_no_stray_uids_or_directories_when_idle(sb: Sandbox) -> None:
    await asyncio.gather(*(sb.run("print(1)") for _ in range(8)))
    uids = sb._uids  # type: ignore[attr-defined]
    if uids is not None:
        assert processes_with_uid_in(uids.base, uids.base + 4096) == []
    root = sb._root  # type: ignore[attr-defined]
    res = await sb.run(f"import os\nprint([p for p in (f'{root}/{{k}}{{i}}' for i in range(1, 400)"
                       " for k in 'rs')\n       if os.path.exists(p) and p != os.getcwd()])")
    assert res.stdout == "[]\n"  # no run or session directory outlives its run or session

"""``session.fork()``: a live persistent-python session forks copy-on-write. The fork starts with
the parent's variables, files and working directory, then both continue independently (state,
files, processes, limits), and neither can see or signal the other."""

from __future__ import annotations

import json

import pytest
import pytest_asyncio

from palaestra.sandbox import Sandbox, SandboxSession
from palaestra.sandbox.errors import SandboxError

pytestmark = pytest.mark.asyncio(loop_scope="module")

IDS = "import json, os\nprint(json.dumps({'pid': os.getpid(), 'cwd': os.getcwd()}))"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sb():
    async with Sandbox(session_cpu_seconds=30) as box:
        if box._fork_refusal() is not None:  # type: ignore[attr-defined]
            pytest.skip(box._fork_refusal())  # type: ignore[attr-defined]
        yield box


async def _ids(s: SandboxSession) -> dict:
    res = await s.run(IDS)
    assert res.ok, res
    return json.loads(res.stdout)


async def test_fork_carries_state_files_and_cwd_then_both_diverge(sb: Sandbox) -> None:
    async with sb.session(persistent_python=True) as parent:
        setup = ("import os\nx = [1, 2]\nfh = open('log.txt', 'w'); fh.write('a')\n"
                 "os.makedirs('sub', exist_ok=True); os.chdir('sub')")
        assert (await parent.run(setup)).ok
        child = await parent.fork()
        try:
            # everything carried over: variables, an open file object, the directory inside
            got = await child.run("fh.write('b'); fh.close()\nprint(x, open('../log.txt').read(),"
                                  " os.path.basename(os.getcwd()))")
            assert got.stdout == "[1, 2] ab sub\n", got
            # then each goes its own way
            assert (await parent.run("x.append('p'); open('../only_parent', 'w').write('1')")).ok
            assert (await child.run("x.append('c')")).ok
            assert (await parent.run("print(x)")).stdout == "[1, 2, 'p']\n"
            assert (await child.run("print(x)")).stdout == "[1, 2, 'c']\n"
            assert (await child.run("print(os.path.exists('../only_parent'))")).stdout == "False\n"
            assert (await parent.run("fh.close(); print(open('../log.txt').read())")).stdout \
                == "a\n"
            # host-side file calls address each session's own workspace
            await child.write_file("from_host.txt", "c")
            assert await child.read_file("from_host.txt") == b"c"
            with pytest.raises(SandboxError):
                await parent.read_file("from_host.txt")
            assert child.workdir != parent.workdir
        finally:
            await child.close()
        assert (await parent.run("print(len(x))")).stdout == "3\n"  # unharmed by the close


async def test_a_fork_cannot_see_signal_or_read_its_sibling(sb: Sandbox) -> None:
    async with sb.session(persistent_python=True) as parent:
        assert (await parent.run("open('secret.txt', 'w').write('s3cret')")).ok
        child = await parent.fork()
        try:
            p, c = await _ids(parent), await _ids(child)
            probe = ("import os, json\n"
                     "def try_kill(pid):\n"
                     "    try:\n        os.kill(pid, 9)\n        return 'sent'\n"
                     "    except OSError as e:\n        return type(e).__name__\n"
                     "def try_read(path):\n"
                     "    try:\n        return open(path).read()\n"
                     "    except OSError as e:\n        return type(e).__name__\n"
                     "print(json.dumps({'kill': try_kill(OTHER),"
                     " 'proc': os.path.exists(f'/proc/{OTHER}'),"
                     " 'pids': sorted(int(d) for d in os.listdir('/proc') if d.isdigit()),"
                     " 'read': try_read(WHERE + '/secret.txt'), 'me': os.getpid()}))")
            from_parent = await parent.run(probe.replace("OTHER", str(c["pid"]))
                                           .replace("WHERE", repr(c["cwd"])))
            from_child = await child.run(probe.replace("OTHER", str(p["pid"]))
                                         .replace("WHERE", repr(p["cwd"])))
            for res, other in ((from_parent, c), (from_child, p)):
                info = json.loads(res.stdout)
                assert info["kill"] in ("PermissionError", "ProcessLookupError"), info
                assert info["proc"] is False and other["pid"] not in info["pids"], info
                assert info["pids"] == [info["me"]], info  # /proc shows nobody else
                assert info["read"] == "PermissionError", info
            # both still alive after the attempted kills
            assert (await child.run("print('child ok')")).stdout == "child ok\n"
            assert (await parent.run("print('parent ok')")).stdout == "parent ok\n"
        finally:
            await child.close()


async def test_processes_and_limits_are_the_forks_own(sb: Sandbox) -> None:
    async with sb.session(persistent_python=True) as parent:
        assert (await parent.run("state = 'kept'")).ok
        child = await parent.fork()
        grandchild = await child.fork()
        try:
            # a runaway cell in the fork times out and takes only the fork's interpreter
            hung = await child.run("while True:\n    pass", timeout=1.0)
            assert hung.timed_out, hung
            assert (await parent.run("print(state)")).stdout == "kept\n"
            assert (await grandchild.run("print(state)")).stdout == "kept\n"
            # the fork's next cell gets a fresh interpreter (its files stay)
            again = await child.run("print('state' in dir())")
            assert again.stdout.endswith("False\n"), again
            # memory: exhausting its own address-space limit is the grandchild's problem only
            oom = await grandchild.run("b = bytearray(10 * 1024 ** 3)")
            assert oom.oom_killed or oom.exit_code != 0, oom
            assert (await parent.run("print(state)")).stdout == "kept\n"
            # closing the parent leaves its forks running
        finally:
            await grandchild.close()
            await child.close()


async def test_closing_the_parent_keeps_the_fork(sb: Sandbox) -> None:
    parent = await sb.session(persistent_python=True).open()
    assert (await parent.run("v = 7")).ok
    child = await parent.fork()
    await parent.close()
    try:
        assert (await child.run("print(v * 6)")).stdout == "42\n"
        grandchild = await child.fork()
        assert (await grandchild.run("print(v)")).stdout == "7\n"
        await grandchild.close()
    finally:
        await child.close()


async def test_fork_refusals_are_clear(sb: Sandbox) -> None:
    async with sb.session() as plain:
        with pytest.raises(SandboxError, match="persistent_python"):
            await plain.fork()
    async with sb.session(persistent_python=True) as parent:
        forks = []
        with pytest.raises(SandboxError, match="Landlock layer"):
            for _ in range(20):
                forks.append(await parent.fork())
        assert 10 <= len(forks) < 16
        assert (await parent.run("print('alive')")).stdout == "alive\n"
        for f in forks:
            await f.close()

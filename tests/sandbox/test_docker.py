"""Docker-only behaviour: container settings, sessions, crash handling, image cache."""

from __future__ import annotations

import asyncio
import json

import pytest
import pytest_asyncio
from sandbox_testutil import requires_docker

from palaestra.sandbox import ExecResult, Sandbox

pytestmark = [pytest.mark.docker, requires_docker(), pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sb():
    async with Sandbox(backend="docker", memory_mb=256) as box:
        yield box


async def test_container_is_locked_down(sb: Sandbox) -> None:
    code = """
import json, os
caps = {l.split(':')[0]: l.split()[1] for l in open('/proc/self/status') if l.startswith('Cap')}
try:
    open('/usr/evil', 'w'); root_rw = True
except OSError:
    root_rw = False
net = '/sys/class/net'
print(json.dumps({"uid": os.getuid(), "caps": caps, "root_rw": root_rw,
                  "ifaces": sorted(os.listdir(net)) if os.path.isdir(net) else []}))
"""
    res = await sb.run(code)
    assert res.ok, res
    info = json.loads(res.stdout)
    assert info["uid"] == 65534 and not info["root_rw"]
    assert set(info["caps"].values()) == {"0000000000000000"}
    assert info["ifaces"] in ([], ["lo"])  # network_mode="none"
    assert sb.mode["network"] == "none" and sb.mode["cap_drop"] == "ALL"  # type: ignore[attr-defined]


async def test_docker_session_and_persistent_python(sb: Sandbox) -> None:
    async with sb.session(persistent_python=True) as s:
        assert (await s.run("counter = 1")).ok
        assert (await s.run("counter += 1\nprint(counter)")).stdout == "2\n"
        await s.write_file("dir/a.txt", "A")
        assert await s.read_file("dir/a.txt") == b"A"
        assert (await s.run_command(["cat", "dir/a.txt"])).stdout == "A"
        res = await s.run("while True:\n    pass", timeout=1.0)
        assert res.timed_out
        res = await s.run("print(counter)")
        assert "restarted" in res.stderr and "NameError" in res.stderr
        assert await s.read_file("dir/a.txt") == b"A"  # files survive the restart


async def test_dead_container_gives_an_error_result(sb: Sandbox) -> None:
    async with sb.session() as s:
        task = asyncio.ensure_future(s.run("import time\ntime.sleep(30)", timeout=60))
        await asyncio.sleep(1.0)
        sb._client.api.kill(s._handle.zyg.container_id)  # type: ignore[attr-defined,union-attr]
        res = await asyncio.wait_for(task, 30)
        assert isinstance(res, ExecResult) and res.error and res.exit_code == -1
        res = await s.run("print('fresh container')")  # the session gets a new container
        assert res.ok and res.stdout == "fresh container\n"


async def test_image_build_is_cached() -> None:
    from palaestra.sandbox.docker_image import build_image

    tag = await asyncio.to_thread(build_image, log=False)  # up to date: no rebuild
    assert tag == "palaestra-sandbox:py3"


async def test_docker_sessions_refuse_to_fork_and_say_why(sb: Sandbox) -> None:
    from palaestra.sandbox.errors import SandboxError

    async with sb.session(persistent_python=True) as s:
        assert (await s.run("x = 1")).ok
        with pytest.raises(SandboxError, match="cannot fork sessions.*backend='local'"):
            await s.fork()
        assert (await s.run("print(x)")).stdout == "1\n"  # the session is unharmed

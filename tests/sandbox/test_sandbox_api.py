"""The public API is pinned (names, fields, signatures), stays light to import, and rejects bad
input with errors that say how to fix it."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import pickle
import subprocess
import sys
import time

import pytest

import palaestra.sandbox as sandbox
from palaestra.errors import ConfigError, PalaestraError, SandboxError
from palaestra.sandbox import (
    DockerSandbox,
    ExecLimiter,
    ExecResult,
    LocalSandbox,
    Sandbox,
    SandboxConfig,
    SandboxSession,
)


def test_public_names() -> None:
    for name in ("Sandbox", "LocalSandbox", "DockerSandbox", "ExecResult", "SandboxConfig",
                 "SandboxSession", "ExecLimiter", "probe_isolation", "judge_run",
                 "SandboxError", "SandboxFileError",
                 "IsolationUnavailableError"):
        assert name in sandbox.__all__ and getattr(sandbox, name) is not None
    with pytest.raises(AttributeError):
        sandbox.NoSuchThing  # noqa: B018


def test_exec_result_fields() -> None:
    names = [f.name for f in dataclasses.fields(ExecResult)]
    assert names[:6] == ["stdout", "stderr", "exit_code", "timed_out", "duration_s", "oom_killed"]
    res = ExecResult("a", "b", 0)
    assert res.ok and res.summary() == "exit 0"
    assert pickle.loads(pickle.dumps(res)) == res
    killed = ExecResult("", "", 137)
    assert killed.signal == 9 and "SIGKILL" in killed.summary()
    fail = ExecResult.failure("boom")
    assert not fail.ok and fail.error == "boom" and fail.exit_code == -1


def test_signatures_match_the_issue() -> None:
    run = inspect.signature(Sandbox.run)
    assert list(run.parameters)[1:] == ["code", "language", "timeout", "stdin", "files"]
    assert run.parameters["language"].default == "python"
    assert run.parameters["timeout"].default == 5.0
    assert run.parameters["stdin"].default is None
    cmd = inspect.signature(Sandbox.run_command)
    assert list(cmd.parameters)[1:] == ["argv", "timeout", "stdin", "files"]
    assert list(inspect.signature(Sandbox.read_file).parameters)[1:] == ["path"]
    assert list(inspect.signature(Sandbox.write_file).parameters)[1:] == ["path", "data"]
    for meth in ("run", "run_command", "read_file", "write_file"):
        assert inspect.iscoroutinefunction(getattr(Sandbox, meth))
        assert inspect.iscoroutinefunction(getattr(SandboxSession, meth))


def test_factory_picks_the_backend() -> None:
    assert type(Sandbox()) is LocalSandbox
    assert type(Sandbox(backend="docker")) is DockerSandbox
    assert type(Sandbox(backend="local", memory_mb=128)).__name__ == "LocalSandbox"
    with pytest.raises(ConfigError, match="unknown sandbox backend"):
        Sandbox(backend="vm")
    with pytest.raises(ConfigError, match="not 'docker'"):
        LocalSandbox(backend="docker")


def test_import_is_light() -> None:
    code = ("import sys, palaestra.sandbox; from palaestra.sandbox import Sandbox, ExecResult;"
            "Sandbox(); bad = [m for m in ('docker', 'torch', 'pyseccomp', 'ray') "
            "if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_config_reports_all_problems_at_once() -> None:
    with pytest.raises(ConfigError) as err:
        SandboxConfig(memory_mb=0, max_processes=1, rate_limit_per_s=-1)
    text = str(err.value)
    assert "memory_mb" in text and "max_processes" in text and "rate_limit_per_s" in text
    with pytest.raises(ConfigError, match="unknown sandbox option"):
        Sandbox(memroy_mb=10)
    with pytest.raises(ConfigError, match="persistent_python=True needs stateful"):
        SandboxConfig(persistent_python=True)
    assert isinstance(err.value, PalaestraError) and isinstance(err.value, ValueError)
    assert SandboxConfig(cpu_seconds=None).cpu_limit(2.5) == 4


@pytest.mark.parametrize("kwargs, match", [
    ({"timeout": 0}, "timeout"),
    ({"timeout": float("nan")}, "timeout"),
    ({"language": "cobol"}, "unsupported language"),
    ({"files": {"../x": b""}}, "relative path"),
    ({"files": {"/etc/x": b""}}, "relative path"),
    ({"files": {"a": 3}}, "bytes or str"),
    ({"stdin": 5}, "bytes or str"),
])
async def test_bad_arguments_raise_before_anything_runs(kwargs: dict, match: str) -> None:
    sb = Sandbox()  # never started: validation happens first
    with pytest.raises(SandboxError, match=match):
        await sb.run("print(1)", **kwargs)
    with pytest.raises(SandboxError, match="non-empty list"):
        await sb.run_command("ls -la")
    with pytest.raises(SandboxError, match="stateful"):
        await sb.read_file("x")
    await sb.close()


async def test_limiter_caps_concurrency_and_rate() -> None:
    lim = ExecLimiter(max_concurrency=2)
    peak = 0

    async def job() -> None:
        nonlocal peak
        async with lim:
            peak = max(peak, lim.in_flight)
            await asyncio.sleep(0.02)

    await asyncio.gather(*(job() for _ in range(10)))
    assert peak == 2
    rate = ExecLimiter(max_concurrency=10, rate_per_s=50, burst=1)
    t0 = time.monotonic()
    for _ in range(6):
        async with rate:
            pass
    assert time.monotonic() - t0 >= 5 / 50 * 0.9  # 5 waits of 20 ms after the first token
    with pytest.raises(ConfigError):
        ExecLimiter(max_concurrency=0)


async def test_shared_limiter_bounds_several_sandboxes() -> None:
    lim = ExecLimiter(max_concurrency=1)
    async with Sandbox(limiter=lim) as a, Sandbox(limiter=lim) as b:
        assert a.limiter is b.limiter is lim
        code = "import time; t = time.time(); time.sleep(0.3); print(t)"
        ra, rb = await asyncio.gather(a.run(code), b.run(code))
    starts = sorted(float(r.stdout) for r in (ra, rb))
    assert starts[1] - starts[0] >= 0.25  # the second waited for the first


def test_a_sandbox_survives_a_change_of_event_loop() -> None:
    """Sync env code calls ``asyncio.run`` per step: one sandbox must serve every such loop."""
    sb = Sandbox()

    async def step(code: str) -> str:
        await sb.start()
        return (await sb.run(code)).stdout

    assert asyncio.run(step("print('first loop')")) == "first loop\n"
    assert asyncio.run(step("print('second loop')")) == "second loop\n"
    asyncio.run(sb.close())

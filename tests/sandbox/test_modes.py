"""The weaker isolation modes still hold the core guarantees, and the sandbox fails closed.

* runs keeping uid 0 without capabilities in their own pid namespace (``per_run_uid=False``),
* ``unshare`` instead of bubblewrap (filesystem confined by Landlock alone),
* no network namespace at all: refused unless ``allow_network_isolation_fallback=True``, and
  then seccomp + Landlock still block sockets and writes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from pathlib import Path

import pytest
from sandbox_testutil import host_processes_matching, planted_secrets

from palaestra.errors import ConfigError
from palaestra.sandbox import IsolationUnavailableError, Sandbox
from palaestra.sandbox import local as local_mod
from palaestra.sandbox.probe import probe_isolation

REPO_FILE = Path(__file__).resolve().parents[2] / "pyproject.toml"
PROBE = f"""
import json, os, socket
out = {{}}
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1); out["net"] = "open"
except OSError:
    out["net"] = "blocked"
for name, path in [("tmp", "/tmp/palaestra-mode-escape"),
                   ("repo", {str(REPO_FILE.parent / 'escape')!r})]:
    try:
        open(path, "w").write("x"); out[name] = "written"
    except OSError:
        out[name] = "blocked"
try:
    out["read_repo"] = "read" if open({str(REPO_FILE)!r}).read() else "empty"
except OSError:
    out["read_repo"] = "blocked"
out["secret"] = os.environ.get("PALAESTRA_TEST_SECRET")
print(json.dumps(out))
"""
EXPECTED = {"net": "blocked", "tmp": "blocked", "repo": "blocked", "read_repo": "blocked",
            "secret": None}


async def _check_core(sb: Sandbox) -> None:
    import json

    with planted_secrets():
        res = await sb.run(PROBE, timeout=10)
    assert res.ok, res
    assert json.loads(res.stdout) == EXPECTED
    res = await sb.run("while True:\n    pass", timeout=1.0)
    assert res.timed_out and res.exit_code == 137
    marker = f"66{uuid.uuid4().int % 10**6}.5"
    res = await sb.run(f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'], "
                       "start_new_session=True)")
    assert res.ok
    deadline = time.monotonic() + 5
    while host_processes_matching(marker) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert host_processes_matching(marker) == []
    res = await sb.run("x = bytearray(8 * 1024 ** 3)")
    assert res.oom_killed and res.exit_code == 137
    assert (await sb.run("print('clean')")).stdout == "clean\n"


async def test_pid_namespace_mode() -> None:
    async with Sandbox(per_run_uid=False) as sb:
        assert sb.mode["per_run_pidns"] and not sb.mode["per_run_uid"]
        await _check_core(sb)
        async with sb.session(persistent_python=True) as s:
            await s.run("v = 7")
            assert (await s.run("print(v)")).stdout == "7\n"


async def test_unshare_launcher_without_bubblewrap() -> None:
    if not probe_isolation().unshare:
        pytest.skip("unshare cannot create namespaces here")
    async with Sandbox(use_bwrap=False) as sb:
        assert sb.mode["launcher"] == "unshare"
        await _check_core(sb)


def _no_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Simulate a machine where neither bubblewrap nor unshare can make namespaces."""
    real = probe_isolation()
    fake = dataclasses.replace(real, bwrap=None, bwrap_version=None, unshare=None)
    monkeypatch.setattr(local_mod, "probe_isolation", lambda: fake)


async def test_fails_closed_without_network_isolation(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_namespaces(monkeypatch)
    sb = Sandbox()
    with pytest.raises(IsolationUnavailableError, match="allow_network_isolation_fallback"):
        await sb.start()
    await sb.close()
    with pytest.raises(IsolationUnavailableError):
        await Sandbox().run("print(1)")  # a first run must not silently run unisolated


async def test_explicit_fallback_still_blocks_sockets_and_writes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _no_namespaces(monkeypatch)
    async with Sandbox(allow_network_isolation_fallback=True) as sb:
        assert sb.mode["launcher"] == "none" and sb.mode["seccomp"]
        # no network namespace, but as root still a uid and a pid namespace per run
        assert sb.mode["per_run_pidns"] and sb.mode["private_proc"]
        assert sb.mode["per_run_uid"] == probe_isolation().root
        import json

        with planted_secrets():
            res = await sb.run(PROBE, timeout=10)
        assert res.ok, res
        assert json.loads(res.stdout) == EXPECTED


async def test_memory_limit_below_the_warm_interpreter_is_refused() -> None:
    pytest.importorskip("numpy")
    with pytest.raises(ConfigError, match="memory_mb"):
        async with Sandbox(memory_mb=64, preload=("numpy",)):  # numpy alone maps > 32 MiB
            pass

"""No run can read another run's payload out of memory (issue 18, reward integrity).

Every run is forked from a warm zygote. If the zygote ever held an earlier request's code,
stdin, files or output in its own memory, even freed, each later fork would inherit a copy,
and a run that scans its own address space (``/proc/self/mem``, ctypes) would find it: an
agent's run reading a grading run's hidden tests. These tests plant secrets through every
channel (code, argv, stdin, files, output; session cells, ``write_file`` and ``read_file``),
then let later runs on the same (single) worker scan all of their readable memory.

Each secret is ``MARK`` + 32 hex digits; the scanner's own code holds only ``MARK`` (built at
run time, never followed by hex digits), so anything it finds came from someone else.
"""

from __future__ import annotations

import json
import uuid

import pytest
import pytest_asyncio
from sandbox_testutil import docker_status

from palaestra.sandbox import Sandbox
from palaestra.sandbox.probe import probe_isolation

IN_MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")

MARK = "PLSTRLEAK"
#: scans every readable mapping of its own process for MARK followed by 32 hex digits
SCANNER = """
import ctypes, json, re
mark = "PLSTR" + "LEAK"
pat = re.compile(re.escape(mark.encode()) + rb"([0-9a-f]{32})")
found, regions, failed = set(), 0, 0
mem = open("/proc/self/mem", "rb", buffering=0)
for line in open("/proc/self/maps").read().splitlines():
    parts = line.split()
    lo, hi = (int(x, 16) for x in parts[0].split("-"))
    if parts[1][0] != "r" or (len(parts) > 5 and parts[5] in ("[vvar]", "[vsyscall]",
                                                              "[vvar_vclock]")):
        continue
    try:
        mem.seek(lo)
        data = mem.read(hi - lo)
    except OSError:
        try:
            data = ctypes.string_at(lo, hi - lo)
        except Exception:
            failed += 1
            continue
    regions += 1
    found.update(m.group(1).decode() for m in pat.finditer(data))
print(json.dumps({"found": sorted(found), "regions": regions, "failed": failed}))
"""


def _secret() -> str:
    return uuid.uuid4().hex


def _launchers() -> list:
    unshare_ok = probe_isolation().unshare is not None
    params = ["default", pytest.param("unshare", marks=pytest.mark.skipif(
        not unshare_ok, reason="unshare cannot create namespaces here"))]
    ok, reason = docker_status()
    params.append(pytest.param("docker", marks=[pytest.mark.docker,
                                                 pytest.mark.skipif(not ok, reason=reason)]))
    return params


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=_launchers())
async def sb(request: pytest.FixtureRequest):
    # One worker: the planting runs and the scanning runs share one zygote.
    kwargs: dict = {"workers": 1, "max_concurrency": 4}
    if request.param == "unshare":
        kwargs["use_bwrap"] = False
    if request.param == "docker":
        kwargs = {"backend": "docker", "docker_pool_size": 1}
    async with Sandbox(**kwargs) as box:
        yield box


async def _scan(sb: Sandbox, runs: int = 3) -> set[str]:
    """What later runs find in their own memory (several: spares are forked at other times)."""
    found: set[str] = set()
    for _ in range(runs):
        res = await sb.run(SCANNER, timeout=30)
        assert res.ok, res
        view = json.loads(res.stdout)
        assert view["regions"] > 10, view  # it really read its heap
        found.update(view["found"])
    return found


@IN_MODULE_LOOP
async def test_a_run_cannot_read_an_earlier_runs_code_stdin_files_or_output(sb: Sandbox) -> None:
    code_s, stdin_s, file_s, out_s, argv_s = (_secret() for _ in range(5))
    res = await sb.run(
        f"secret = {MARK + code_s!r}\n"
        "import sys\n"
        "data = sys.stdin.read()\n"
        "hidden = open('hidden_tests.py').read()\n"
        # the output secret exists only in this run's output, nowhere in its inputs
        f"print({MARK!r} + {out_s[::-1]!r}[::-1], len(data), len(hidden))\n",
        stdin=(MARK + stdin_s).encode(), files={"hidden_tests.py": f"# {MARK}{file_s}\n"})
    assert res.ok and res.stdout.startswith(MARK + out_s), res
    res = await sb.run_command(["/bin/echo", MARK + argv_s])
    assert res.ok and argv_s in res.stdout, res
    found = await _scan(sb)
    leaked = {name for name, s in [("code", code_s), ("stdin", stdin_s), ("file", file_s),
                                   ("output", out_s), ("argv", argv_s)] if s in found}
    assert not leaked, f"a later run read an earlier run's {sorted(leaked)} from memory"


@IN_MODULE_LOOP
async def test_a_run_cannot_read_a_sessions_cells_or_files(sb: Sandbox) -> None:
    cell_s, cell_in_s, write_s, read_s, cell_out_s = (_secret() for _ in range(5))
    async with sb.session(persistent_python=True) as s:
        await s.write_file("grader.py", f"# {MARK}{write_s}\n")
        res = await s.run(f"x = {MARK + cell_s!r}\nimport sys\nn = len(sys.stdin.read())\n"
                          f"open('made.txt', 'w').write({MARK!r} + {read_s[::-1]!r}[::-1])\n"
                          f"print({MARK!r} + {cell_out_s[::-1]!r}[::-1])",
                          stdin=(MARK + cell_in_s).encode())
        assert res.ok and cell_out_s in res.stdout, res
        assert read_s in (await s.read_file("made.txt")).decode()
        found = await _scan(sb)
    leaked = {name for name, s in [("cell code", cell_s), ("cell stdin", cell_in_s),
                                   ("write_file", write_s), ("read_file", read_s),
                                   ("cell output", cell_out_s)] if s in found}
    assert not leaked, f"a later run read a session's {sorted(leaked)} from memory"


@IN_MODULE_LOOP
async def test_the_scanner_finds_its_own_secrets(sb: Sandbox) -> None:
    """The scan is real: a secret in the scanning run's own input is found."""
    own = _secret()
    res = await sb.run(f"s = {MARK + own!r}\n" + SCANNER, timeout=30)
    assert res.ok, res
    assert own in json.loads(res.stdout)["found"]


def test_the_pipe_transport_moves_payloads_without_the_zygote_reading_them(tmp_path) -> None:
    """The Docker transport (stdin/stdout pipes, Docker absent here or not): payloads are
    spliced into memfds and outputs sent from them; sizes and bytes survive the trip."""
    import os
    import subprocess
    import sys

    from palaestra.sandbox.spec import RunSpec
    from palaestra.sandbox.config import SandboxConfig
    from palaestra.sandbox.inner.framing import FrameReader, pack
    from palaestra.sandbox.inner.payload import _Bounce
    from palaestra.sandbox.requests import ZygoteRequests
    from palaestra.sandbox.shipping import runtime_argv

    proc = subprocess.Popen(runtime_argv(sys.executable, {"stdio": True}),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    requests = ZygoteRequests(SandboxConfig(), count_processes=False)
    reader = FrameReader(1 << 31)
    pending: list = []

    def ask(header: dict, blobs: list[bytes] = ()) -> tuple[dict, list[bytes]]:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(pack(header, blobs))
        proc.stdin.flush()
        while not pending:
            pending.extend(reader.feed(os.read(proc.stdout.fileno(), 1 << 20)))
        return pending.pop(0)

    try:
        ready, _ = ask({"op": "init", "opts": {"max_output": 100_000, "landlock": False}}, [b""])
        assert ready["op"] == "ready"
        where = {"workdir": str(tmp_path), "uid": None}
        big = os.urandom(3 << 20)  # larger than a pipe: several splices
        code = ("import sys; d = sys.stdin.buffer.read(); f = open('f.bin', 'rb').read()\n"
                "print(len(d), d == f); sys.stdout.write('x' * 200_000)")
        header, blobs = requests.run(RunSpec("python", code, (), 5.0, big, (("f.bin", big),)),
                                     create_workdir=False, **where)
        done, out = ask(dict(header, id=1), blobs)
        assert out[0].startswith(b"3145728 True\n") and len(out[0]) == 100_000, done
        assert done["out_size"] == 200_000 + 13  # the full size; the capped bytes came back
        assert ask({"op": "write_file", "root": str(tmp_path), "path": "w.txt", "id": 2},
                   [b"hello"])[0]["op"] == "ok"
        reply, blobs = ask({"op": "read_file", "root": str(tmp_path), "path": "f.bin",
                            "limit": 1 << 24, "id": 3})
        assert reply["op"] == "ok" and blobs[0] == big
        cell = RunSpec("python", "import sys; print(open('w.txt').read(), sys.stdin.read())",
                       (), 5.0, b"in", ())
        header, blobs = requests.cell(cell, session="s1", had_kernel=False, **where)
        done, out = ask(dict(header, id=4), blobs)
        assert out[0] == b"hello in\n", done
    finally:
        proc.kill()
        proc.wait()
    # the fallback copy (for channels the kernel cannot splice) leaves its buffer zeroed
    bounce = _Bounce(4096)
    r, w = os.pipe()
    dst = os.memfd_create("t")
    os.write(w, b"s3cret" * 1000)
    assert bounce.move(r, dst, 6000) == 0
    assert os.pread(dst, 6000, 0) == b"s3cret" * 1000 and not any(bounce.buf)
    for fd in (r, w, dst):
        os.close(fd)

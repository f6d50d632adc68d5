"""The in-sandbox runtime ships as module sources in argv: each module imports only the standard
library and runtime modules executed before it, and fits one argv entry; the shipped command
starts a zygote that answers on its pipes (the Docker transport)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

from palaestra.sandbox.inner import MODULES
from palaestra.sandbox.inner.framing import FrameReader, pack
from palaestra.sandbox.shipping import runtime_argv, runtime_sources

MAX_ARG_STRLEN = 128 * 1024  # the kernel's limit on one argv entry


def test_modules_import_only_the_stdlib_and_earlier_modules() -> None:
    sources = dict(runtime_sources())
    assert list(sources) == list(MODULES)
    for i, (name, source) in enumerate(runtime_sources()):
        assert len(source.encode()) < MAX_ARG_STRLEN, name
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and node.module in MODULES[:i], (name, node.module)
            elif isinstance(node, ast.ImportFrom):
                assert node.module.split(".")[0] in sys.stdlib_module_names, (name, node.module)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    top = alias.name.split(".")[0]
                    assert top in sys.stdlib_module_names, (name, alias.name)


def test_the_shipped_command_starts_a_zygote() -> None:
    proc = subprocess.Popen(runtime_argv(sys.executable, {"stdio": True}),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(pack({"op": "init", "opts": {"landlock": False}}, [b""]))
        proc.stdin.write(pack({"op": "ping", "id": 7}))
        proc.stdin.flush()
        reader, frames = FrameReader(1 << 20), []
        while len(frames) < 2:
            frames += reader.feed(proc.stdout.read1(1 << 16))
        (ready, _), (pong, _) = frames
        assert ready["op"] == "ready" and "landlock_abi" in ready["features"]
        assert pong == {"op": "ok", "id": 7, "blobs": []}
        assert json.loads(proc.args[proc.args.index("-c") + 2]) == {"stdio": True}
    finally:
        proc.kill()
        proc.wait()

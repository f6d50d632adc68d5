"""``palaestra tinker-server`` as a process: it prints its URL, answers /api/v1/healthz and stops
on SIGTERM; without the tinker SDK it says how to install it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_command_prints_its_url_and_serves_healthz(model_dir: str) -> None:
    import httpx

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "palaestra", "tinker-server", "--model", model_dir,
         "--port", "0", "--device", "cpu", "--base-model-name", "local/tiny"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        url = None
        assert proc.stdout is not None
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            m = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
            url = m.group(1) if m else None
        assert url, "the command printed no URL"
        assert httpx.get(url + "/api/v1/healthz", timeout=10).json() == {"status": "ok"}
        caps = httpx.get(url + "/api/v1/get_server_capabilities", timeout=10).json()
        assert caps["supported_models"][0]["model_name"] == "local/tiny"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_without_the_sdk_the_command_says_how_to_install_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from palaestra.tinker_api import cli

    monkeypatch.setitem(sys.modules, "tinker.proto.tinker_public_pb2", None)
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    assert cli.run(parser.parse_args(["--model", "x"])) == 2
    assert "pip install 'palaestra[tinker]'" in capsys.readouterr().err

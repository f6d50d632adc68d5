"""``palaestra sandbox doctor`` and ``palaestra sandbox run`` through the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "palaestra.cli", "sandbox", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_doctor_reports_the_isolation_in_force() -> None:
    out = _cli("doctor", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    local = report["local"]
    assert local["ok"] and local["network"].startswith("blocked")
    assert local["write_outside"].startswith("blocked") and local["host_env_visible"] is False
    assert report["probe"]["network_isolation"] in ("bwrap", "unshare")
    assert local["pid"] == 2 and local["visible_pids"] <= 2  # its own pid namespace and /proc
    assert local["signal_parent"].startswith("blocked")
    mode = local["mode"]
    assert mode["launcher"] == report["probe"]["network_isolation"]
    assert mode["per_run_pidns"] and mode["private_proc"] and mode["workspace_quota_mb"]
    assert mode["per_run_uid"] == report["probe"]["root"]
    assert (local["uid"] != 0) == report["probe"]["root"]
    text = _cli("doctor")
    assert text.returncode == 0 and "layers in force" in text.stdout
    assert "local sandbox live check: OK" in text.stdout
    for layer in ("launcher: ", "uid separation: ", "pid namespace: each run its own",
                  "/proc: private per run", "workspace quota: "):
        assert layer in text.stdout, text.stdout


def test_run_a_file(tmp_path: Path) -> None:
    prog = tmp_path / "prog.py"
    prog.write_text("import sys\nprint('hello', sys.stdin.read())\nsys.exit(4)\n")
    data = tmp_path / "in.txt"
    data.write_text("world")
    out = _cli("run", str(prog), "--stdin", str(data))
    assert out.returncode == 4
    assert out.stdout == "hello world\n" and "exit 4" in out.stderr

"""A wheel built from the repo installs into a fresh venv and its CLI works from there."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_installs_and_cli_runs(tmp_path):
    pytest.importorskip("hatchling")
    pytest.importorskip("build")
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "dist"), str(ROOT)],
        check=True, capture_output=True,
    )
    wheel = next((tmp_path / "dist").glob("palaestra-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for component in ("envs", "agents", "rollout", "sandbox", "trainers", "benchmarks"):
        assert any(n.startswith(f"palaestra/{component}/") for n in names), component
    assert len(names) == len(set(names))
    # A fresh venv that sees the already-installed dependencies but not the editable palaestra.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)], check=True)
    where = subprocess.run(
        [str(py), "-c", "import palaestra; print(palaestra.__file__)"],
        capture_output=True, text=True, check=True, cwd=tmp_path,
    ).stdout
    assert str(venv) in where, where
    out = subprocess.run(
        [str(venv / "bin" / "palaestra"), "envs", "list"], capture_output=True, text=True, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert "palaestra/Calculator-v0" in out.stdout

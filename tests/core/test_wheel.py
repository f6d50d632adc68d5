"""A wheel built from the repo installs into a fresh venv and its CLI works from there.

The fresh venv has no system site-packages: the base interpreter of a fresh machine holds none
of the project's packages, so a test that leaned on them would pass only where someone had
installed things by hand. Its dependencies come from a folder that exposes the project venv's
installed distributions *except palaestra itself*, and pip installs the wheel with ``--no-index``:
it resolves the wheel's declared requirements (versions included) against that folder, so a
declared requirement that the project's own set-up does not install fails the install, and no
download happens.
"""

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _dependency_folder(target: Path) -> Path:
    """Links to every entry of this interpreter's site-packages except palaestra's own."""
    site_packages = Path(sysconfig.get_paths()["purelib"])
    target.mkdir()
    for entry in site_packages.iterdir():
        name = entry.name.lower()
        if name.startswith(("palaestra", "_editable_impl_palaestra", "__editable__")):
            continue
        if name.endswith(".pth"):  # path hooks of the project venv (the editable install)
            continue
        os.symlink(entry, target / entry.name)
    return target


@pytest.mark.slow
def test_wheel_installs_and_cli_runs(tmp_path):
    pytest.importorskip("hatchling")
    pytest.importorskip("build")
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir",
         str(tmp_path / "dist"), str(ROOT)],
        check=True, capture_output=True,
    )
    wheel = next((tmp_path / "dist").glob("palaestra-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for component in ("envs", "agents", "engines", "rollout", "sandbox", "trainers", "run",
                      "benchmarks", "tinker_api"):
        assert any(n.startswith(f"palaestra/{component}/") for n in names), component
    assert len(names) == len(set(names))

    venv = tmp_path / "venv"
    # no system site-packages, and no pip/setuptools of its own to shadow the dependencies:
    # this interpreter's pip installs into it (`pip --python`)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    venv_site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    deps = _dependency_folder(tmp_path / "deps")
    Path(venv_site, "palaestra_test_deps.pth").write_text(f"{deps}\n")

    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-index",
         str(wheel)],
        capture_output=True, text=True,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    where = subprocess.run(
        [str(py), "-c", "import palaestra, gymnasium; print(palaestra.__file__)"],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert where.returncode == 0, where.stderr
    assert str(venv) in where.stdout, where.stdout
    out = subprocess.run(
        [str(venv / "bin" / "palaestra"), "envs", "list"], capture_output=True, text=True,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "palaestra/Calculator-v0" in out.stdout


def test_base_interpreter_is_not_on_the_fresh_venv_path(tmp_path):
    """The guard itself: a venv made without system site-packages cannot see the base's."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    paths = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sys; print('\\n'.join(sys.path))"],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    base_site = sysconfig.get_paths(vars={"base": sys.base_prefix,
                                          "platbase": sys.base_prefix})["purelib"]
    assert base_site not in paths

"""`import palaestra` and `palaestra --help` stay light and fast (checked in a fresh interpreter)."""

import subprocess
import sys

HEAVY = ("torch", "ray", "sglang", "megatron", "docker", "transformers")


def _loaded_after(code: str) -> set[str]:
    probe = code + "\nimport sys; print(','.join(m for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    loaded = set(out.stdout.strip().split(","))
    return {h for h in HEAVY if h in loaded}


def test_import_palaestra_loads_nothing_heavy():
    assert _loaded_after("import palaestra, palaestra.types, palaestra.errors, palaestra.config") == set()


def test_envs_package_loads_nothing_heavy():
    assert _loaded_after("import palaestra.envs") == set()


def test_cli_help_is_fast_and_light():
    assert _loaded_after("from palaestra.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass") == set()
    out = subprocess.run([sys.executable, "-m", "palaestra", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "train" in out.stdout


def test_subpackages_are_attributes_loaded_on_first_use():
    code = (
        "import sys, palaestra\n"
        "assert 'palaestra.envs' not in sys.modules and 'envs' in dir(palaestra)\n"
        "env = palaestra.envs.make('palaestra/Calculator-v0')\n"
        "assert palaestra.tool_parsers.get_parser('qwen').name == 'hermes'\n"
    )
    assert _loaded_after(code) == set()

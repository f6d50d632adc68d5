"""Modules declare their envs in a ``PALAESTRA_ENVS`` table that the envs registry registers when
a ``"module:id"`` names them; importing such a module registers nothing (no import side effect)."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from palaestra.envs.registry import register_declared
from palaestra.errors import EnvNotFoundError


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_importing_a_module_registers_nothing_and_make_registers_its_table() -> None:
    out = _run(
        "import gymnasium\n"
        "import palaestra.rollout.testing as t\n"
        "print(t.FLAKY_ENV_ID in gymnasium.registry)\n"
        "from palaestra.envs import make\n"
        "env = make(t.FLAKY_ENTRY)\n"
        "print(type(env).__name__, t.FLAKY_ENV_ID in gymnasium.registry)\n"
        "env.close()\n"
    )
    assert out.splitlines() == ["False", "FlakyCalculatorEnv True"]


def test_the_external_env_is_declared_not_registered_at_import() -> None:
    out = _run(
        "import gymnasium\n"
        "import palaestra.rollout.gateway.external as x\n"
        "print(x.EXTERNAL_ENV_ID in gymnasium.registry)\n"
        "from palaestra.envs.registry import lookup\n"
        "print(lookup(x.EXTERNAL_ENV)[0])\n"
    )
    assert out.splitlines() == ["False", "palaestra-gateway/External-v0"]


def test_a_malformed_table_is_refused_with_how_to_fix() -> None:
    bad = types.ModuleType("bad_envs")
    bad.PALAESTRA_ENVS = ["not", "a", "mapping"]  # type: ignore[attr-defined]
    with pytest.raises(EnvNotFoundError, match="must map env ids to entry points"):
        register_declared(bad)

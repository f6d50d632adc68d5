"""``palaestra gateway``: its options parse, and the package and command import nothing heavy."""

from __future__ import annotations

import argparse
import subprocess
import sys

HEAVY = ("torch", "transformers", "ray", "aiohttp", "openai")


def test_gateway_package_and_command_are_light():
    probe = ("import palaestra.rollout.gateway, palaestra.rollout.gateway.cli, "
             "palaestra.envs.external_agent, sys; print(','.join(sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    loaded = set(out.stdout.strip().split(","))
    assert {h for h in HEAVY if h in loaded} == set()


def test_gateway_command_options():
    from palaestra.rollout.gateway.cli import configure

    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(["--engine", "http://a:1", "--engine", "http://b:2",
                              "--tokenizer", "m", "--port", "0", "--auto-sessions"])
    assert args.engine == ["http://a:1", "http://b:2"] and args.auto_sessions
    assert args.family == "qwen" and args.max_context is None  # the engines' context
    help_text = subprocess.run([sys.executable, "-m", "palaestra", "gateway", "--help"],
                               check=False, capture_output=True, text=True)
    assert help_text.returncode == 0 and "--honor-client-sampling" in help_text.stdout

"""The ``palaestra`` command line: a thin dispatcher that imports a command's module only when run.

Each command lives in its component (``palaestra.envs.cli``, ``palaestra.sandbox.cli``, ...) and
defines ``configure(parser)`` and ``run(args) -> int``. ``palaestra --help`` imports none of them,
so it answers instantly and pulls in no torch, ray, sglang, megatron or docker.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: command -> (module defining configure/run, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "envs": ("palaestra.envs.cli", "list, check and play environments"),
    "sandbox": ("palaestra.sandbox.cli", "inspect the code sandbox (doctor) and run code in it"),
    "init-model": ("palaestra.tiny_model", "build the tiny local model and tokenizer (no downloads)"),
    "serve": ("palaestra.engines.serve.serve", "serve a model with the embedded engine over HTTP"),
    "serve-retriever": ("palaestra.envs.search.serve", "serve a BM25 index with the Search-R1 API"),
    "train": ("palaestra.run.cli", "train a policy (RL, SFT, DPO) from a TOML config"),
    "eval": ("palaestra.benchmarks.cli", "evaluate a model on benchmarks; compare runs"),
    "gateway": ("palaestra.rollout.gateway.cli", "OpenAI-compatible gateway for external agents"),
    "engines": ("palaestra.run.engines_cli",
                "add, remove and list the engines of a running training run"),
    "tinker-server": ("palaestra.tinker_api.cli",
                      "serve a local model with the Tinker training and sampling API"),
}


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="palaestra",
        description="Gym-style platform for training LLM agents with reinforcement learning.",
        epilog="Run `palaestra COMMAND --help` for the options of a command.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("command", nargs="?", choices=sorted(COMMANDS), metavar="COMMAND",
                        help="; ".join(f"{k}: {v[1]}" for k, v in COMMANDS.items()))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    # Only the first token decides the command, so `--help` never imports a command module.
    if not argv or argv[0] in ("-h", "--help") or argv[0] == "--version":
        args = top.parse_args(argv[:1])
        if args.version:
            from palaestra import __version__

            print(__version__)
            return 0
        top.print_help()
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        top.error(f"unknown command {name!r}; choose from {', '.join(sorted(COMMANDS))}")
    module_name, help_text = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"palaestra {name}", description=help_text)
    module.configure(parser)
    if getattr(module, "ACCEPTS_OVERRIDES", False):
        # config commands take any `--section.key value` override after their own flags
        args, overrides = parser.parse_known_args(rest)
        args.overrides = overrides
    else:
        args = parser.parse_args(rest)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())

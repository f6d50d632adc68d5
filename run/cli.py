"""``palaestra train CONFIG [--section.key value ...]``: validate the config, then train.

The config is parsed and validated (every problem at once: field ranges, the env id, the data
files and their rows, loss settings the loop can serve; `palaestra.run.config_checks`)
before torch is imported, before the run directory is made; a user error prints that one
message and exits 2. ``--dry-run`` stops there and prints the resolved config and the plan;
``--help-config`` lists every field with its type, default and help text.
"""

from __future__ import annotations

import argparse

#: unknown ``--section.key value`` flags reach `run` as ``args.overrides``
ACCEPTS_OVERRIDES = True


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="TOML config file (see configs/)")
    parser.add_argument("--out", help="run directory (overrides `out` in the config)")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the config, print it and the placement plan, start nothing")
    parser.add_argument("--help-config", action="store_true",
                        help="list every config field with its help text")
    parser.add_argument("--no-resume", action="store_true",
                        help="start over even if the run directory has checkpoints")
    parser.epilog = "Any config field can be overridden: --rollout.group_size 8 --trainer.steps 5"


def run(args: argparse.Namespace) -> int:
    import sys

    from palaestra.config import describe_fields, load_config
    from palaestra.errors import ConfigError
    from palaestra.run.config import TrainConfig

    if args.help_config:
        print("\n".join(describe_fields(TrainConfig)))
        return 0
    if not args.config:
        print("palaestra train: give a config file, e.g. configs/quickstart.toml", file=sys.stderr)
        return 2
    overrides = list(getattr(args, "overrides", []))
    if args.out:
        overrides += ["--out", args.out]
    if args.no_resume:
        overrides += ["--checkpoint.resume", "false"]
    try:  # a real run also checks what only this machine can tell (the model is here)
        cfg = load_config(TrainConfig, args.config, overrides, context={"launch": not args.dry_run})
    except ConfigError as exc:
        print(f"palaestra train: {exc}", file=sys.stderr)
        return 2
    from palaestra.run.train import check_run_dir  # light: imports no torch

    try:  # a run directory with other fixed settings is refused before any work
        check_run_dir(cfg)
    except ConfigError as exc:
        print(f"palaestra train: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        from palaestra.run.dry_run import describe_plan

        try:
            print(describe_plan(cfg))
        except ConfigError as exc:
            print(f"palaestra train: {exc}", file=sys.stderr)
            return 2
        return 0
    from palaestra.run.train import train

    try:
        result = train(cfg)
    except ConfigError as exc:  # a user error found only once the run starts
        print(f"palaestra train: {exc}", file=sys.stderr)
        return 2
    if result:
        print("held-out success rate by stage: "
              + ", ".join(f"{k}={v:.3f}" for k, v in result.items()))
    print(f"run directory: {cfg.out}")
    return 0

"""The README's env-registration example works when pasted into a new file."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_register_example_runs(tmp_path):
    text = README.read_text()
    code = re.search(r"Save this as `my_env.py`.*?```python\n(.*?)```", text, re.S).group(1)
    (tmp_path / "my_env.py").write_text(code)
    out = subprocess.run([sys.executable, "my_env.py"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "Reverse the word:" in out.stdout and "1.0, True" in out.stdout
    check = subprocess.run(
        [sys.executable, "-m", "palaestra", "envs", "check", "my_env:mine/Reverse-v0"],
        cwd=tmp_path, capture_output=True, text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_readme_names_the_two_commands():
    text = README.read_text()
    assert "palaestra train configs/quickstart.toml" in text and "bash scripts/test.sh" in text


def _readme_commands() -> list[list[str]]:
    """Every ``palaestra ...`` command in the README's code blocks, as argv after ``palaestra``.

    ``a | b | c`` after a command lists alternative subcommands; ``[...]`` is optional syntax
    (dropped); comments after ``#`` are dropped.
    """
    import shlex

    commands = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", README.read_text(), re.DOTALL):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            at = line.find("palaestra ")
            if at < 0 or line.startswith(("from ", "import ")):
                continue
            line = re.sub(r"\[[^\]]*\]", "", line[at + len("palaestra "):])
            head, *alternatives = [part.strip() for part in line.split(" | ")]
            argv = shlex.split(head)
            commands.append(argv)
            for alternative in alternatives:  # `envs list | check ID` -> `envs check ID`
                commands.append([argv[0], *shlex.split(alternative)])
    return commands


def test_readme_commands_parse_against_the_real_cli():
    import argparse
    import contextlib
    import importlib
    import io

    from palaestra.cli import COMMANDS

    commands = _readme_commands()
    assert len(commands) >= 12 and ["eval", "compare", "runs/evalA", "runs/evalB"] in commands
    problems = []
    for argv in commands:
        name, rest = argv[0], argv[1:]
        if name not in COMMANDS:
            problems.append(f"palaestra {' '.join(argv)}: no command {name!r}")
            continue
        module = importlib.import_module(COMMANDS[name][0])
        parser = argparse.ArgumentParser(prog=f"palaestra {name}")
        module.configure(parser)
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                if getattr(module, "ACCEPTS_OVERRIDES", False):
                    _, overrides = parser.parse_known_args(rest)
                    assert all(not o.startswith("--") or "." in o for o in overrides), overrides
                else:
                    parser.parse_args(rest)
        except SystemExit:
            problems.append(f"palaestra {' '.join(argv)}: {err.getvalue().strip()}")
    assert not problems, "\n".join(problems)

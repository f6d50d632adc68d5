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

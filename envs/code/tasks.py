"""Code tasks: HumanEval and MBPP rows turned into a prompt, a solution program and a test spec.

The test spec is what the in-sandbox harness (`palaestra.envs.code.harness`) runs; it never
reaches the model or the solution's process.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from palaestra.errors import ConfigError

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function (signature "
    "included) in a ```python code block.\n\n```python\n{prompt}```"
)
MBPP_INSTRUCTION = (
    "{text}\nYour code should pass tests like this:\n{tests}\n"
    "Reply with the complete Python code in a ```python code block."
)


@dataclass(frozen=True)
class CodeTask:
    """One task: what the model reads, how its code becomes a program, and the hidden tests."""

    kind: str  # "humaneval" or "asserts"
    instruction: str
    spec: dict[str, Any]
    n_tests: int
    entry_point: str | None = None
    prompt: str = ""

    def program(self, code: str) -> str:
        """The solution program: HumanEval code is completed onto its prompt."""
        if self.kind != "humaneval":
            return code
        if _defines(code, self.entry_point):
            return f"{self.prompt}\n\n{code}"  # the prompt's imports and helpers stay available
        return self.prompt + code  # a body-only completion of the prompt


def _defines(code: str, name: str | None) -> bool:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return "def " in code  # let the harness report the syntax error on the full code
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
               for n in tree.body)


def _count_check_asserts(test: str) -> int:
    """Top-level asserts of ``def check`` plus one for running ``check`` to its end."""
    for node in ast.parse(test).body:
        if isinstance(node, ast.FunctionDef) and node.name == "check":
            return sum(isinstance(s, ast.Assert) for s in node.body) + 1
    raise ConfigError("a HumanEval 'test' must define check(candidate)")


def code_task(row: Mapping[str, Any], *, shown_tests: int = 1) -> CodeTask:
    """A `CodeTask` from a HumanEval row or an MBPP row (full or sanitized layout)."""
    if {"prompt", "entry_point", "test"} <= set(row):
        prompt = str(row["prompt"])
        return CodeTask(
            kind="humaneval",
            instruction=HUMANEVAL_INSTRUCTION.format(prompt=prompt),
            spec={"kind": "humaneval", "prompt": prompt, "test": str(row["test"]),
                  "entry_point": str(row["entry_point"])},
            n_tests=_count_check_asserts(str(row["test"])),
            entry_point=str(row["entry_point"]),
            prompt=prompt,
        )
    if "test_list" in row and ("text" in row or "prompt" in row):
        tests = [str(t) for t in row["test_list"]]
        if not tests:
            raise ConfigError("an MBPP row needs a non-empty 'test_list'")
        setup = "\n".join(
            [*(str(i) for i in row.get("test_imports") or []), str(row.get("test_setup_code") or "")]
        ).strip()
        text = str(row.get("text", row.get("prompt")))
        shown = "\n".join(tests[: max(0, shown_tests)])
        return CodeTask(
            kind="asserts",
            instruction=MBPP_INSTRUCTION.format(text=text, tests=shown) if shown else (
                f"{text}\nReply with the complete Python code in a ```python code block."
            ),
            spec={"kind": "asserts", "setup": setup, "asserts": tests},
            n_tests=len(tests),
        )
    raise ConfigError(
        "a code task must be a HumanEval row {'task_id', 'prompt', 'entry_point', 'test'} or an "
        f"MBPP row {{'task_id', 'text', 'test_list'}}; got keys {sorted(row)}"
    )

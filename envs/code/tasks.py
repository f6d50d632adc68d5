"""Code tasks: HumanEval and MBPP rows turned into a prompt, a solution program and a test spec.

The test spec is what the in-sandbox harness (`palaestra.envs.code.harness`) runs; it never
reaches the model or the solution's process. Its ``solution_names`` are the only names the tests
take from the solution (see `solution_names`); every other name the tests use (builtins, modules,
the prompt's helpers) is the grader's own.
"""

from __future__ import annotations

import ast
import builtins
import sys
from collections.abc import Iterable, Mapping
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


def _used_names(sources: Iterable[str]) -> set[str]:
    used: set[str] = set()
    for source in sources:
        try:
            used |= {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
        except SyntaxError:
            pass  # the harness reports a broken test when it runs it
    return used


def _bound_names(source: str, *, imports: bool = True) -> set[str]:
    """Names a module binds at top level: defs, classes, assignments (and imports)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    bound: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and imports:
            bound |= {(a.asname or a.name).partition(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return bound


def _stubs(prompt: str) -> set[str]:
    """Functions the prompt only declares (docstring, ``pass``, ``...``): the model writes them."""
    def is_stub(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
        return all(isinstance(s, ast.Pass) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
                   for s in function.body)

    return {n.name for n in ast.parse(prompt).body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and is_stub(n)}


def solution_names(row: Mapping[str, Any]) -> list[str]:
    """The names the hidden tests take from the solution; everything else is the grader's.

    HumanEval: the entry point and the prompt's other stubs the test calls by name (HumanEval/33
    calls ``sort_third``); the prompt's implemented helpers (``poly``, ``encode_cyclic``) and its
    imports stay the trusted prompt versions. MBPP: the names the reference solution (``code``)
    defines and the tests use (``Pair``, ``Node``, and ``sum`` for task 126, which redefines the
    builtin), or without a reference the tests' free names that are neither builtins nor
    modules nor bound by the test setup. A solution that defines ``abs`` or ``math`` therefore
    changes nothing the tests see.
    """
    if {"prompt", "entry_point", "test"} <= set(row):
        entry = str(row["entry_point"])
        used = _used_names([str(row["test"])])
        return sorted({entry} | (_stubs(str(row["prompt"])) & used))
    setup = _setup_source(row)
    used = _used_names([setup, *(str(t) for t in row["test_list"])])
    used -= _bound_names(setup)
    if row.get("entry_point"):
        code = str(row.get("code") or "")
        return sorted({str(row["entry_point"])} | (used & _bound_names(code, imports=False)))
    if row.get("code"):  # what the reference imports (MBPP 596: sys) the grader imports itself
        return sorted(used & _bound_names(str(row["code"]), imports=False))
    return sorted(used - set(dir(builtins)) - set(sys.stdlib_module_names))


def _setup_source(row: Mapping[str, Any]) -> str:
    return "\n".join(
        [*(str(i) for i in row.get("test_imports") or []), str(row.get("test_setup_code") or "")]
    ).strip()


def code_task(row: Mapping[str, Any], *, shown_tests: int = 1) -> CodeTask:
    """A `CodeTask` from a HumanEval row or an MBPP row (full or sanitized layout)."""
    if {"prompt", "entry_point", "test"} <= set(row):
        prompt = str(row["prompt"])
        return CodeTask(
            kind="humaneval",
            instruction=HUMANEVAL_INSTRUCTION.format(prompt=prompt),
            spec={"kind": "humaneval", "prompt": prompt, "test": str(row["test"]),
                  "entry_point": str(row["entry_point"]), "solution_names": solution_names(row)},
            n_tests=_count_check_asserts(str(row["test"])),
            entry_point=str(row["entry_point"]),
            prompt=prompt,
        )
    if "test_list" in row and ("text" in row or "prompt" in row):
        tests = [str(t) for t in row["test_list"]]
        if not tests:
            raise ConfigError("an MBPP row needs a non-empty 'test_list'")
        setup = _setup_source(row)
        text = str(row.get("text", row.get("prompt")))
        shown = "\n".join(tests[: max(0, shown_tests)])
        return CodeTask(
            kind="asserts",
            instruction=MBPP_INSTRUCTION.format(text=text, tests=shown) if shown else (
                f"{text}\nReply with the complete Python code in a ```python code block."
            ),
            spec={"kind": "asserts", "setup": setup, "asserts": tests,
                  "solution_names": solution_names(row)},
            n_tests=len(tests),
        )
    raise ConfigError(
        "a code task must be a HumanEval row {'task_id', 'prompt', 'entry_point', 'test'} or an "
        f"MBPP row {{'task_id', 'text', 'test_list'}}; got keys {sorted(row)}"
    )

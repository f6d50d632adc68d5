"""The dependency direction of docs/architecture.md, checked over every module's imports.

    core <- {sandbox <- envs <- agents, engines} <- {rollout, trainers} <- run <- benchmarks

``engines`` depends on core only (never sandbox, envs or agents); ``rollout`` and ``trainers``
are peers (neither imports the other: samples cross as core's `Sample`); ``run`` (the
``palaestra train`` application) assembles everything below it and nothing below imports it;
``benchmarks`` (the eval harness and perf scripts) sit on top. A module may import its own
component, core, and the components below it. Checked: top-level and function-level
``import``/``from`` statements (including those under ``if TYPE_CHECKING:``; a type is a
dependency too) and string literals that name a ``palaestra.<component>`` module
(``"palaestra.envs.search:SearchEnv"`` entry points, ``importlib.import_module`` tables), since a
module path in a string is an import a reader cannot follow. Exceptions are the short list
below, each with its reason.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "palaestra"

#: rank of each layer: a module may depend on layers of lower or equal rank
RANK = {"core": 0, "sandbox": 1, "engines": 1, "envs": 2, "agents": 3, "rollout": 4,
        "trainers": 4, "run": 5, "tinker_api": 5, "benchmarks": 6}
COMPONENTS = tuple(c for c in RANK if c != "core")
#: (importer layer, imported layer) pairs refused even though the rank allows them
FORBIDDEN = {
    ("engines", "sandbox"), ("sandbox", "engines"),  # peers on the first floor
    ("rollout", "trainers"), ("trainers", "rollout"),  # peers: the sample contract is core's
    ("trainers", "envs"), ("trainers", "agents"),  # learners see token ids, not messages
}

#: (file relative to the repo root, imported module prefix): reason. Keep this list short.
ALLOWED: dict[tuple[str, str], str] = {
    ("src/palaestra/cli.py", "palaestra."):
        "the CLI dispatch table names each component's command module (imported on demand)",
    ("src/palaestra/__init__.py", "palaestra."):
        "the package face imports its subpackages lazily on attribute access",
    ("run/evaluation.py", "palaestra.benchmarks.training"):
        "the run's one entry point for the training-time evaluator: the loop calls it through "
        "the TrainingEvaluation protocol, the benchmarks (above run) implement it",
}

_MODULE_STRING = re.compile(r"palaestra\.([A-Za-z_]\w*)(?:\.[A-Za-z_]\w*)*(?::[A-Za-z_][\w.]*)?")


def module_files() -> list[tuple[str, str, Path]]:
    """(layer, path shown relative to the repo root, file) for every module of the package."""
    out: list[tuple[str, str, Path]] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in (*COMPONENTS, "data"):  # links to the top-level folders
            continue
        out.append(("core", str(path.relative_to(ROOT)), path))
    for comp in COMPONENTS:
        for path in sorted((ROOT / comp).rglob("*.py")):
            out.append((comp, str(path.relative_to(ROOT)), path))
    return out


def layer_of(module: str) -> str | None:
    """The layer of an absolute module name, None when it is not palaestra's."""
    parts = module.split(".")
    if parts[0] != "palaestra":
        return None
    if len(parts) > 1 and parts[1] in COMPONENTS:
        return parts[1]
    return "core"


def _resolve_relative(node: ast.ImportFrom, shown: str) -> str:
    """The absolute module of a relative ``from . import x`` in the file shown."""
    parts = Path(shown).with_suffix("").parts
    if parts[:2] == ("src", "palaestra"):
        parts = parts[2:]
    pkg = ["palaestra", *parts]
    if pkg[-1] != "__init__":
        pkg = pkg[:-1]
    else:
        pkg = pkg[:-1]
    base = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
    return ".".join([*base, node.module] if node.module else base)


def imports_of(tree: ast.AST, shown: str) -> list[tuple[int, str, str]]:
    """(line, module, how) for every import statement and module-naming string in a tree."""
    found: list[tuple[int, str, str]] = []
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and n.body and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((node.lineno, alias.name, "import"))
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(node, shown) if node.level else (node.module or "")
            found.append((node.lineno, base, "import"))
            if base == "palaestra":  # from palaestra import envs
                for alias in node.names:
                    if alias.name in COMPONENTS:
                        found.append((node.lineno, f"palaestra.{alias.name}", "import"))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docstrings):
            match = _MODULE_STRING.fullmatch(node.value.strip())
            if match:
                found.append((node.lineno, node.value.strip().split(":")[0], "string"))
    return found


def violations() -> list[str]:
    out: list[str] = []
    for layer, shown, path in module_files():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=shown)
        for line, module, how in imports_of(tree, shown):
            target = layer_of(module)
            if target is None or target == layer:
                continue
            if any(shown == f and module.startswith(p) for f, p in ALLOWED):
                continue
            if RANK[target] > RANK[layer] or (layer, target) in FORBIDDEN:
                out.append(f"{shown}:{line}: {layer} -> {target} ({how} {module})")
    return out


def test_scanner_sees_every_kind_of_import() -> None:
    """The scanner finds function-level imports, relative imports and module strings."""
    src = (
        "'''palaestra.envs in a docstring is prose'''\n"
        "def f():\n"
        "    from palaestra.envs.base import Env\n"
        "    import palaestra.benchmarks.runner\n"
        "from ..envs import registry\n"
        "from palaestra import envs\n"
        "RUNNER = 'palaestra.rollout.episode:run_episode'\n"
        "MSG = 'see palaestra.envs for details'\n"
    )
    found = imports_of(ast.parse(src), "run/train.py")
    modules = {(line, module, how) for line, module, how in found}
    assert (3, "palaestra.envs.base", "import") in modules
    assert (4, "palaestra.benchmarks.runner", "import") in modules
    assert (5, "palaestra.envs", "import") in modules
    assert (6, "palaestra.envs", "import") in modules
    assert (7, "palaestra.rollout.episode", "string") in modules
    assert not any(line in (1, 8) for line, _, _ in found)


def test_every_component_is_scanned() -> None:
    layers = {layer for layer, _, _ in module_files()}
    assert layers == set(RANK)
    assert len(module_files()) > 150


def test_imports_follow_the_dependency_direction() -> None:
    bad = violations()
    assert not bad, (
        "imports against core <- {sandbox <- envs <- agents, engines} <- {rollout, trainers} <- "
        "run <- benchmarks (rollout and trainers are peers; engines see core only). Move the "
        "shared piece to core or invert through a registry/protocol:\n" + "\n".join(bad)
    )

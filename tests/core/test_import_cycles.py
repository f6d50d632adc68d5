"""No import cycles among palaestra's modules, function-level imports included.

A module graph is read with ast over every module of the package (core and each linked
component): an edge for every ``import``/``from`` statement at any depth (inside functions too,
since a lazy import is still a dependency that must be loaded in an order). The run-time graph
leaves out those under ``if TYPE_CHECKING:`` (types only, never executed); the type-level graph
keeps them, since two modules that name each other's types are one knot for a reader and a
type checker all the same (`KNOWN_TYPE_CIRCLES` lists those still tolerated: none). ``from pkg import name`` is an edge to the
module ``pkg.name`` when that is a module, else to ``pkg``. A cycle is a strongly connected set of
two or more modules; the remedy is to move the shared piece down (a types module, a factory
above its products), never a lazier import.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "palaestra"


def module_paths() -> dict[str, Path]:
    """Dotted module name -> file, for every module under src/palaestra (links followed)."""
    out: dict[str, Path] = {}
    for folder, dirs, files in os.walk(PACKAGE, followlinks=True):
        dirs[:] = [d for d in dirs if d not in ("__pycache__", "data")]
        for name in files:
            if not name.endswith(".py"):
                continue
            path = Path(folder) / name
            parts = ["palaestra", *path.relative_to(PACKAGE).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


#: type-level circles (TYPE_CHECKING imports included) still tolerated, each as its sorted modules
KNOWN_TYPE_CIRCLES: list[list[str]] = []


def imported_modules(tree: ast.AST, module: str, is_package: bool, known: set[str], *,
                     types: bool = False) -> set[str]:
    """palaestra modules a module imports at run time (any depth; TYPE_CHECKING blocks skipped
    unless ``types``)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not types and isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit_node(other)
                continue
            visit_node(child)

    def visit_node(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.add(sub if sub in known else source)
        visit(node)

    visit(tree)
    return {m for m in found if m in known and m != module}


def import_graph(paths: dict[str, Path], *, types: bool = False) -> dict[str, set[str]]:
    known = set(paths)
    return {
        module: imported_modules(ast.parse(path.read_text(encoding="utf-8")), module,
                                 path.name == "__init__.py", known, types=types)
        for module, path in paths.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of two or more modules (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = [(root, sorted(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, todo = work[-1]
            if todo:
                nxt = todo.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_scanner_sees_function_level_imports_and_skips_type_checking() -> None:
    known = {"palaestra.a", "palaestra.b", "palaestra.c", "palaestra.pkg", "palaestra.pkg.d"}
    src = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from palaestra.c import C\n"
        "def f():\n"
        "    from palaestra.b import thing\n"
        "from palaestra.pkg import d\n"
    )
    found = imported_modules(ast.parse(src), "palaestra.a", False, known)
    assert found == {"palaestra.b", "palaestra.pkg.d"}
    graph = {"palaestra.a": {"palaestra.b"}, "palaestra.b": {"palaestra.c"},
             "palaestra.c": {"palaestra.a"}, "palaestra.pkg": set(),
             "palaestra.pkg.d": {"palaestra.pkg"}}
    assert cycles(graph) == [["palaestra.a", "palaestra.b", "palaestra.c"]]


def test_every_component_is_in_the_graph() -> None:
    paths = module_paths()
    components = {name.split(".")[1] for name in paths if name.count(".") >= 1}
    assert {"engines", "envs", "agents", "rollout", "sandbox", "trainers", "run",
            "benchmarks", "tinker_api"} <= components
    assert len(paths) > 250


def test_there_are_no_import_cycles() -> None:
    found = cycles(import_graph(module_paths()))
    assert not found, (
        "import cycles (function-level imports count; move the shared piece down instead of "
        "importing lazily):\n" + "\n".join(" <-> ".join(c) for c in found)
    )


def test_no_type_level_circles_beyond_the_known() -> None:
    found = cycles(import_graph(module_paths(), types=True))
    assert sorted(found) == sorted(KNOWN_TYPE_CIRCLES), (
        "type-level import circles (TYPE_CHECKING imports count; move the shared type down, or "
        "take a protocol instead of the other module's class):\n"
        + "\n".join(" <-> ".join(c) for c in found))

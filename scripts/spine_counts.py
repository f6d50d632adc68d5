"""Counts the seams of issue #19 over the package: `Any` collaborator parameters, long files and
functions, duplicate blocks.

    .venv/bin/python scripts/spine_counts.py [--json OUT]

- "Any parameters at boundaries": parameters annotated exactly `Any` (or `typing.Any`) on public
  functions and methods (name without a leading underscore, in a public class or at module level);
  the collaborator subset is those whose name says a component object (engine, backend, env, ...).
- "files over 400 lines", "functions over 80 lines" (def line to last line, nested defs included
  in their parent). Triton kernel bodies are not counted as long functions (a function
  decorated ``@triton.jit``, or one that defines such kernels: their length is the kernel's).
- Benchmark scripts (``benchmarks/perf/``: measurement programs, not the package's seams) are
  left out of every measure.
- "duplicate blocks": windows of 8 consecutive non-blank, non-comment lines (whitespace
  stripped) that occur at two or more places; overlapping windows of one run count once.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPONENTS = ("envs", "agents", "engines", "rollout", "sandbox", "trainers", "run", "benchmarks",
              "tinker_api")
COLLABORATORS = {
    "engine", "backend", "spec", "env", "agent", "worker", "manager", "tokenizer", "renderer",
    "parser", "sandbox", "model", "policy", "client", "handle", "cfg", "config", "router",
    "engines", "envs", "workers", "trainer", "session", "store", "cache", "pool", "runner",
}
WINDOW = 8


def package_files() -> list[tuple[str, Path]]:
    """Every module of the package as (dotted-ish display path, file)."""
    out: list[tuple[str, Path]] = []
    core = ROOT / "src" / "palaestra"
    for path in sorted(core.rglob("*.py")):
        rel = path.relative_to(core)
        if rel.parts[0] in (*COMPONENTS, "data"):  # links to the top-level folders
            continue
        out.append((f"src/palaestra/{rel}", path))
    for comp in COMPONENTS:
        for path in sorted((ROOT / comp).rglob("*.py")):
            if path.is_relative_to(ROOT / "benchmarks" / "perf"):  # scripts: see the doc
                continue
            out.append((str(path.relative_to(ROOT)), path))
    return out


def _is_triton_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated ``@triton.jit``, or defining a function that is (a kernel factory)."""
    for node in ast.walk(fn):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if any(ast.unparse(d).startswith("triton.jit") for d in node.decorator_list):
                return True
    return False


def _is_any(node: ast.expr | None) -> bool:
    if node is None:
        return False
    if isinstance(node, ast.Name):
        return node.id == "Any"
    if isinstance(node, ast.Attribute):
        return node.attr == "Any" and isinstance(node.value, ast.Name)
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.strip() in ("Any", "typing.Any")
    return False


def _public_functions(tree: ast.Module):
    """(function, qualified name) for module-level functions and methods of public classes."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if not node.name.startswith("_"):
                yield node, node.name
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if not item.name.startswith("_") or item.name == "__init__":
                        yield item, f"{node.name}.{item.name}"


def _all_functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _normalized_lines(text: str) -> list[tuple[int, str]]:
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        out.append((i, s))
    return out


def count() -> dict:
    any_params: list[str] = []
    any_collab: list[str] = []
    long_files: list[str] = []
    long_funcs: list[str] = []
    windows: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for shown, path in package_files():
        text = path.read_text(encoding="utf-8")
        nlines = text.count("\n") + 1
        if nlines > 400:
            long_files.append(f"{shown} ({nlines})")
        tree = ast.parse(text, filename=str(path))
        for fn, qual in _public_functions(tree):
            args = fn.args
            for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                if a.arg in ("self", "cls"):
                    continue
                if _is_any(a.annotation):
                    where = f"{shown}:{fn.lineno} {qual}({a.arg})"
                    any_params.append(where)
                    if a.arg.lower().rstrip("s") in COLLABORATORS or a.arg.lower() in COLLABORATORS:
                        any_collab.append(where)
        for fn in _all_functions(tree):
            length = (fn.end_lineno or fn.lineno) - fn.lineno + 1
            if length > 80 and not _is_triton_kernel(fn):
                long_funcs.append(f"{shown}:{fn.lineno} {fn.name} ({length})")
        lines = _normalized_lines(text)
        for k in range(len(lines) - WINDOW + 1):
            chunk = "\n".join(s for _, s in lines[k:k + WINDOW])
            if len(chunk) < 200:  # short boilerplate windows (imports, closing brackets)
                continue
            digest = hashlib.sha1(chunk.encode()).hexdigest()
            windows[digest].append((shown, lines[k][0]))
    # a duplicate block = a maximal run of duplicated windows in one file; count runs per file
    dup_starts: dict[str, list[int]] = defaultdict(list)
    for places in windows.values():
        if len(places) < 2:
            continue
        for shown, line in places:
            dup_starts[shown].append(line)
    dup_blocks: list[str] = []
    for shown, starts in sorted(dup_starts.items()):
        starts = sorted(set(starts))
        run_start = prev = starts[0]
        for s in starts[1:] + [None]:
            if s is not None and s - prev <= 3:
                prev = s
                continue
            dup_blocks.append(f"{shown}:{run_start}")
            if s is not None:
                run_start = prev = s
    return {
        "any_params_public": len(any_params),
        "any_params_collaborators": len(any_collab),
        "files_over_400_lines": len(long_files),
        "functions_over_80_lines": len(long_funcs),
        "duplicate_blocks": len(dup_blocks),
        "detail": {
            "any_params_collaborators": any_collab,
            "any_params_public": any_params,
            "files_over_400_lines": long_files,
            "functions_over_80_lines": long_funcs,
            "duplicate_blocks": dup_blocks,
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the counts and their detail here")
    ap.add_argument("--detail", action="store_true", help="print every counted item")
    args = ap.parse_args(argv)
    result = count()
    print(f"{'measure':32s} {'count':>6s}")
    for key in ("any_params_public", "any_params_collaborators", "files_over_400_lines",
                "functions_over_80_lines", "duplicate_blocks"):
        print(f"{key:32s} {result[key]:6d}")
    if args.detail:
        for key, items in result["detail"].items():
            print(f"\n## {key}")
            for item in items:
                print(f"  {item}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

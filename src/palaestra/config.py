"""Typed configuration: pydantic models, TOML files, dotted command-line overrides.

``load_config(TrainConfig, "configs/quickstart.toml", ["--rollout.group_size", "8"])`` reads the
TOML file, applies the overrides (``--a.b value`` or ``--a.b=value``; values parsed as TOML
literals when they can be, else taken as strings), validates everything at once and raises one
`ConfigError` that lists every problem. Field docstrings are the help text
(``use_attribute_docstrings``), shown by `describe_fields`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pydantic

from palaestra.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

C = TypeVar("C", bound=pydantic.BaseModel)


class Section(pydantic.BaseModel):
    """Base of every config section: unknown keys are errors, docstrings are field help."""

    model_config = pydantic.ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_default=True, frozen=False
    )


def parse_overrides(args: Sequence[str]) -> dict[str, Any]:
    """``["--a.b", "3", "--c=x"]`` -> ``{"a": {"b": 3}, "c": "x"}``."""
    out: dict[str, Any] = {}
    items = list(args)
    i = 0
    problems = []
    while i < len(items):
        token = items[i]
        if not token.startswith("--") or len(token) == 2:
            problems.append(f"expected --section.key VALUE, got {token!r}")
            i += 1
            continue
        key, eq, value = token[2:].partition("=")
        if not eq:
            if i + 1 >= len(items) or items[i + 1].startswith("--"):
                value = "true"  # a bare flag sets a boolean
            else:
                i += 1
                value = items[i]
        _set_dotted(out, key.replace("-", "_"), _parse_value(value))
        i += 1
    if problems:
        raise ConfigError("bad command-line overrides:\n  " + "\n  ".join(problems))
    return out


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {dotted!r}: {part!r} is a value, not a section")
    node[leaf] = value


def deep_merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist; pass a TOML file (see configs/)")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML: {exc}") from None


def validate(model: type[C], data: Mapping[str, Any], source: str = "config") -> C:
    """Validate ``data``; one `ConfigError` lists every problem with its dotted path."""
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(root)"
            got = err.get("input")
            shown = "" if isinstance(got, dict) else f" (got {json.dumps(got, default=str)[:60]})"
            lines.append(f"{where}: {err['msg']}{shown}")
        raise ConfigError(
            f"{len(lines)} problem(s) in {source}:\n  " + "\n  ".join(lines)
            + "\nSee `palaestra train --help-config` for every field."
        ) from None


def load_config(
    model: type[C], path: str | Path | None = None, overrides: Sequence[str] = ()
) -> C:
    data = read_toml(path) if path is not None else {}
    data = deep_merge(data, parse_overrides(overrides))
    return validate(model, data, source=str(path) if path else "config")


def save_resolved(config: pydantic.BaseModel, run_dir: str | Path) -> Path:
    """Write the fully resolved config as ``config.json`` beside the run."""
    out = Path(run_dir) / "config.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(config.model_dump_json(indent=2))
    return out


def describe_fields(model: type[pydantic.BaseModel], prefix: str = "") -> Iterator[str]:
    """One help line per leaf field: ``--section.field (type, default): docstring``."""
    for name, field in model.model_fields.items():
        annotation = field.annotation
        dotted = f"{prefix}{name}"
        if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
            yield from describe_fields(annotation, prefix=f"{dotted}.")
            continue
        type_name = getattr(annotation, "__name__", str(annotation)).replace("typing.", "")
        default = "" if field.is_required() else f" = {field.get_default(call_default_factory=True)!r}"
        yield f"--{dotted} ({type_name}{default}): {field.description or ''}".rstrip(": ")

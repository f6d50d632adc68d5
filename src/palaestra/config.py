"""Typed configuration: pydantic models, TOML files, dotted command-line overrides.

``load_config(TrainConfig, "configs/quickstart.toml", ["--rollout.group_size", "8"])`` reads the
TOML file, applies the overrides (``--a.b value`` or ``--a.b=value``; values parsed as TOML
literals when they can be, else taken as strings), validates everything at once and raises one
`ConfigError` that lists every problem. Field docstrings are the help text
(``use_attribute_docstrings``), shown by `describe_fields`.

Checks that span fields (or look at files) run in a model validator that raises `ConfigProblems`
with one `Problem` each. Pydantic runs such a validator only once every field is valid, so
`validate` validates again without the invalid fields (their defaults stand in) to report those
problems in the same error, leaving out the ones that involve an invalid field.

A section whose ``kind`` selects its settings is a tagged union of section models (pydantic's
discriminated union; `union_variants` reads one): errors name the fields without the tag
(``engine.weight_sync.dir``), an unknown field says which kind has it, and `describe_fields`
lists every variant's fields with the kinds that read them.
"""

from __future__ import annotations

import copy
import difflib
import json
import sys
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, Union

import pydantic

from palaestra.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

C = TypeVar("C", bound=pydantic.BaseModel)


@dataclass(frozen=True)
class Problem:
    """One config problem: the dotted fields it involves and what to do about it."""

    fields: tuple[str, ...]
    message: str


class ConfigProblems(ValueError):
    """Raised by a model validator with every problem it found (see `validate`)."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        super().__init__("; ".join(p.message for p in problems))
        self.problems = tuple(problems)

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.problems,)


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


def validate(model: type[C], data: Mapping[str, Any], source: str = "config",
             context: Mapping[str, Any] | None = None) -> C:
    """Validate ``data``; one `ConfigError` lists every problem with its dotted path.

    ``context`` reaches the model validators (pydantic's validation context).
    """
    work: dict[str, Any] = copy.deepcopy(dict(data))  # fields found invalid are dropped from it
    lines: list[str] = []
    invalid: list[str] = []
    for _ in range(4):  # each pass drops the fields found invalid, so the checks across fields run
        try:
            result = model.model_validate(work, context=dict(context or {}))
        except pydantic.ValidationError as exc:
            dropped = False
            for err in exc.errors():
                cause = (err.get("ctx") or {}).get("error")
                if isinstance(cause, ConfigProblems):
                    lines += [p.message for p in cause.problems
                              if not any(_overlaps(f, bad) for f in p.fields for bad in invalid)]
                    continue
                shown, _ = _walk(model, err["loc"])  # the dotted path, without union tags
                where = ".".join(shown)
                lines.append(_describe_error(model, err, where))
                invalid.append(where)
                dropped |= _drop(work, shown)
            if not dropped:
                break
        else:
            if not lines:
                return result
            break
    raise problems_error(lines, source)


def problems_error(messages: Sequence[str], source: str = "config") -> ConfigError:
    """One `ConfigError` listing ``messages`` (each says what is wrong and how to fix it)."""
    return ConfigError(
        f"{len(messages)} problem(s) in {source}:\n  - " + "\n  - ".join(messages)
        + "\nSee `palaestra train --help-config` for every field."
    )


def _describe_error(model: type[pydantic.BaseModel], err: Any, where: str) -> str:
    got = err.get("input")
    shown = "" if isinstance(got, dict) else f" = {json.dumps(got, default=str)[:60]}"
    loc = tuple(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        *parents, leaf = where.split(".")
        close = difflib.get_close_matches(str(leaf), _field_names(model, loc[:-1]), n=1)
        hint = f"; did you mean {'.'.join([*parents, close[0]])}?" if close else ""
        return f"{where or '(root)'}: unknown field{hint or _other_kinds(model, loc)}"
    if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
        variants = _variants_at(model, loc) or {}
        kinds = ", ".join(map(repr, variants))
        if err["type"] == "union_tag_not_found":
            return f"{where}{shown}: must be a section with kind = one of {kinds}"
        return f"{where}.kind = {err['ctx']['tag']!r}: must be one of {kinds}"
    bound = _BOUNDS.get(err["type"])
    if bound is not None:
        op, key = bound
        field = _section(model, loc[:-1])
        info = field.model_fields.get(loc[-1]) if field is not None else None
        about = (info.description or "").replace("\n", " ").split(". ")[0] if info else ""
        about = f" ({about.rstrip('.')})" if about else ""
        return f"{where}{shown}: must be {op} {err['ctx'][key]}{about}"
    message = str(err["msg"]).removeprefix("Value error, ")
    return f"{where or '(root)'}{shown}: {message}"


#: pydantic's range error types -> (operator, key of the bound in the error's ctx)
_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
           "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}


def union_variants(field: Any) -> dict[str, type[pydantic.BaseModel]] | None:
    """``{tag: section model}`` of a tagged-union field (a `FieldInfo`), None for another field.

    A variant's tag is its ``Tag`` annotation, else the value of its discriminator field
    (``kind`` unless the field names another)."""
    annotation = getattr(field, "annotation", None)
    if typing.get_origin(annotation) not in (Union, types.UnionType):
        return None
    discriminator = getattr(field, "discriminator", None)
    key = discriminator if isinstance(discriminator, str) else "kind"
    out: dict[str, type[pydantic.BaseModel]] = {}
    for member in typing.get_args(annotation):
        tag = None
        if typing.get_origin(member) is typing.Annotated:
            member, *meta = typing.get_args(member)
            tag = next((m.tag for m in meta if isinstance(m, pydantic.Tag)), None)
        if not (isinstance(member, type) and issubclass(member, pydantic.BaseModel)):
            return None  # a union of plain values (e.g. ``str | None``)
        if tag is None:
            kind = member.model_fields.get(key)
            values = typing.get_args(kind.annotation) if kind is not None else ()
            if len(values) != 1:
                return None
            tag = str(values[0])
        out[tag] = member
    return out


def _walk(model: type[pydantic.BaseModel], loc: Sequence[Any]) -> tuple[list[str], Any]:
    """Follow an error's ``loc`` through the model tree: the dotted parts without the union
    tags, and where it ends (a section model, a ``{tag: model}`` dict of a union, or None)."""
    node: Any = model
    shown: list[str] = []
    for raw in loc:
        part = str(raw)
        if isinstance(node, dict):  # a tagged union: this part is the tag of a variant
            if part in node:
                node = node[part]
                continue
            node = None
        shown.append(part)
        if not (isinstance(node, type) and issubclass(node, pydantic.BaseModel)):
            node = None
            continue
        field = node.model_fields.get(part)
        variants = union_variants(field) if field is not None else None
        node = variants if variants is not None else (field.annotation if field else None)
    return shown, node


def _section(model: type[pydantic.BaseModel], loc: Sequence[Any]) -> type[pydantic.BaseModel] | None:
    """The section model at ``loc`` (tags of unions included; None when it leaves the tree)."""
    _, node = _walk(model, loc)
    return node if isinstance(node, type) and issubclass(node, pydantic.BaseModel) else None


def _variants_at(model: type[pydantic.BaseModel], loc: Sequence[Any]) -> dict[str, Any] | None:
    _, node = _walk(model, loc)
    return node if isinstance(node, dict) else None


def _field_names(model: type[pydantic.BaseModel], loc: Sequence[Any]) -> list[str]:
    """Field names of the section at ``loc`` (empty when the path leaves the model tree)."""
    section = _section(model, loc)
    return list(section.model_fields) if section is not None else []


def _other_kinds(model: type[pydantic.BaseModel], loc: Sequence[str]) -> str:
    """For an unknown field of a union's variant: which kinds have it (else "")."""
    if len(loc) < 2:
        return ""
    variants = _variants_at(model, loc[:-2])
    if not variants or loc[-2] not in variants:
        return ""
    owners = [tag for tag, variant in variants.items() if loc[-1] in variant.model_fields]
    if not owners:
        return ""
    shown, _ = _walk(model, loc[:-2])
    return (f"; it is a setting of {'.'.join(shown)}.kind = {' / '.join(map(repr, owners))}, "
            f"the {loc[-2]!r} kind never reads it: remove it, or choose that kind")


def _drop(data: dict[str, Any], loc: Sequence[Any]) -> bool:
    """Remove the deepest key of ``data`` on the path ``loc``; True when one was removed."""
    node: Any = data
    parent, key = None, None
    for part in loc:
        if not isinstance(node, dict) or part not in node:
            break
        parent, key, node = node, part, node[part]
    if parent is None:
        return False
    del parent[key]
    return True


def _overlaps(a: str, b: str) -> bool:
    """True when one dotted path is the other or lies inside it."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".") or not a or not b


def load_config(
    model: type[C], path: str | Path | None = None, overrides: Sequence[str] = (),
    context: Mapping[str, Any] | None = None,
) -> C:
    data = read_toml(path) if path is not None else {}
    data = deep_merge(data, parse_overrides(overrides))
    return validate(model, data, source=str(path) if path else "config", context=context)


def save_resolved(config: pydantic.BaseModel, run_dir: str | Path) -> Path:
    """Write the fully resolved config as ``config.json`` beside the run."""
    out = Path(run_dir) / "config.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(config.model_dump_json(indent=2))
    return out


def describe_fields(model: type[pydantic.BaseModel], prefix: str = "") -> Iterator[str]:
    """One help line per leaf field: ``--section.field (type, default): docstring``.

    A tagged union lists its ``kind`` (the choices and the default), then every field of its
    variants once, with the kinds that read it."""
    for name, field in model.model_fields.items():
        annotation = field.annotation
        dotted = f"{prefix}{name}"
        variants = union_variants(field)
        if variants is not None:
            yield from _describe_union(field, variants, dotted)
            continue
        if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
            yield from describe_fields(annotation, prefix=f"{dotted}.")
            continue
        yield _field_line(dotted, field)


def _field_line(dotted: str, field: Any, kinds: str = "") -> str:
    annotation = field.annotation
    type_name = getattr(annotation, "__name__", str(annotation)).replace("typing.", "")
    default = "" if field.is_required() else f" = {field.get_default(call_default_factory=True)!r}"
    about = " ".join((field.description or "").split())  # one line per field
    return f"--{dotted} ({type_name}{default}){kinds}: {about}".rstrip(": ")


def _describe_union(field: Any, variants: Mapping[str, type[pydantic.BaseModel]],
                    dotted: str) -> Iterator[str]:
    default = field.get_default(call_default_factory=True)
    chosen = f" = {default.kind!r}" if hasattr(default, "kind") else ""
    about = " ".join((field.description or "").split())
    yield f"--{dotted}.kind (one of {', '.join(map(repr, variants))}{chosen}): {about}".rstrip(": ")
    readers: dict[str, list[str]] = {}
    for tag, variant in variants.items():
        for name in variant.model_fields:
            if name != "kind":
                readers.setdefault(name, []).append(tag)
    for name, tags in readers.items():
        sub = variants[tags[0]].model_fields[name]
        if isinstance(sub.annotation, type) and issubclass(sub.annotation, pydantic.BaseModel):
            yield from describe_fields(sub.annotation, prefix=f"{dotted}.{name}.")
            continue
        kinds = "" if len(tags) == len(variants) else f" [kind {' / '.join(tags)}]"
        yield _field_line(f"{dotted}.{name}", sub, kinds)

"""Typed Python callables as OpenAI tools: schema from the signature and docstring, validated calls.

``Tool.from_function(fn)`` builds the JSON schema with pydantic from ``fn``'s type hints and takes
parameter descriptions from a Google-style ``Args:`` section. `Tool.invoke` validates the raw JSON
arguments the model wrote and runs the function (sync functions in a thread unless marked
non-blocking), returning text or raising `ToolError` with a message meant for the model.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import re
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, get_type_hints

import pydantic

from palaestra.errors import ConfigError, ToolError

ToolFunction = Callable[..., Any] | Callable[..., Awaitable[Any]]

_ARG_LINE = re.compile(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.+)$")


def tool(fn: ToolFunction | None = None, *, blocking: bool = True, name: str | None = None) -> Any:
    """Mark a method of a `ToolEnv` as a tool. ``blocking=False`` runs it on the event loop."""

    def mark(f: ToolFunction) -> ToolFunction:
        # setattr: a function takes no new attributes as far as the type checker knows
        setattr(f, "__palaestra_tool__", {"blocking": blocking, "name": name or f.__name__})  # noqa: B010
        return f

    return mark(fn) if fn is not None else mark


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into its summary and per-argument descriptions."""
    lines = inspect.cleandoc(doc).splitlines() if doc else []
    summary: list[str] = []
    args: dict[str, str] = {}
    in_args = False
    current: str | None = None
    for line in lines:
        stripped = line.strip()
        if stripped.lower() in ("args:", "arguments:", "parameters:"):
            in_args = True
            continue
        if in_args:
            if stripped.endswith(":") and not line.startswith(" "):
                in_args = False  # next section (Returns:, Raises:)
                continue
            match = _ARG_LINE.match(line)
            if match and line.startswith((" ", "\t")) and len(line) - len(line.lstrip()) <= 4:
                current = match.group(1)
                args[current] = match.group(2).strip()
            elif current and stripped:
                args[current] += " " + stripped
        elif not args and stripped and not stripped.endswith(":"):
            summary.append(stripped)
        elif summary and not stripped:
            in_args = in_args  # blank line ends the summary paragraph
    return " ".join(summary), args


def _strip_titles(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _strip_titles(v) for k, v in schema.items() if k != "title"}
    if isinstance(schema, list):
        return [_strip_titles(v) for v in schema]
    return schema


@dataclass(frozen=True)
class Tool:
    """A callable exposed to the model, with its OpenAI schema and argument validator."""

    name: str
    description: str
    function: ToolFunction
    arguments_model: type[pydantic.BaseModel]
    blocking: bool = True

    @classmethod
    def from_function(
        cls, fn: ToolFunction, *, name: str | None = None, blocking: bool | None = None
    ) -> Tool:
        marks = getattr(fn, "__palaestra_tool__", {})
        tool_name = name or marks.get("name") or fn.__name__
        is_blocking = marks.get("blocking", True) if blocking is None else blocking
        summary, model = _described(fn, tool_name)
        return cls(
            name=tool_name,
            description=summary or f"The {tool_name} tool.",
            function=fn,
            arguments_model=model,
            blocking=is_blocking and not inspect.iscoroutinefunction(fn),
        )

    @staticmethod
    def _describe(fn: ToolFunction, tool_name: str) -> tuple[str, type[pydantic.BaseModel]]:
        """The docstring summary and the arguments model of ``fn`` (see `_described`)."""
        summary, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
        try:
            hints = get_type_hints(fn)
        except Exception as exc:  # unresolvable forward references
            raise ConfigError(f"tool {tool_name!r}: cannot resolve type hints ({exc})") from exc
        fields: dict[str, Any] = {}
        for param in inspect.signature(fn).parameters.values():
            if param.name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            if param.name not in hints:
                raise ConfigError(
                    f"tool {tool_name!r}: parameter {param.name!r} needs a type hint "
                    "(the model sees the types in the tool schema)"
                )
            default = ... if param.default is inspect.Parameter.empty else param.default
            fields[param.name] = (
                hints[param.name],
                pydantic.Field(default, description=arg_docs.get(param.name)),
            )
        model = pydantic.create_model(  # type: ignore[call-overload]
            f"{tool_name}_arguments", __config__=pydantic.ConfigDict(extra="forbid"), **fields
        )
        return summary, model

    def schema(self) -> dict[str, Any]:
        """The OpenAI ``tools[i]`` entry (a fresh copy: the caller may edit it)."""
        params = _PARAMETERS.get(self.arguments_model)
        if params is None:  # pydantic's schema generation costs ~1 ms: once per model
            params = _strip_titles(self.arguments_model.model_json_schema())
            params.pop("additionalProperties", None)
            params.setdefault("properties", {})
            _PARAMETERS[self.arguments_model] = params
        params = copy.deepcopy(params)
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": params},
        }

    def validate(self, raw_arguments: str) -> dict[str, Any]:
        """Decode and type-check the model's JSON arguments; `ToolError` says what is wrong."""
        try:
            decoded = json.loads(raw_arguments) if raw_arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ToolError(
                f"the arguments of {self.name!r} are not valid JSON ({exc.msg} at position "
                f"{exc.pos}); write them as a JSON object, e.g. {self._example()}"
            ) from None
        if not isinstance(decoded, dict):
            raise ToolError(
                f"the arguments of {self.name!r} must be a JSON object, got "
                f"{type(decoded).__name__}; e.g. {self._example()}"
            )
        try:
            validated = self.arguments_model.model_validate(decoded)
        except pydantic.ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'arguments'}: {err['msg']}"
                for err in exc.errors()
            )
            raise ToolError(f"invalid arguments for {self.name!r}: {problems}") from None
        return {k: getattr(validated, k) for k in type(validated).model_fields}

    async def invoke(self, raw_arguments: str) -> Any:
        kwargs = self.validate(raw_arguments)
        if inspect.iscoroutinefunction(self.function):
            return await self.function(**kwargs)
        if self.blocking:
            return await asyncio.to_thread(self.function, **kwargs)
        return self.function(**kwargs)

    def _example(self) -> str:
        props = self.arguments_model.model_fields
        return json.dumps({k: f"<{k}>" for k in props})


# One description per function: every env of a class binds the same tool methods, so their
# argument models and schemas are built once per process, not once per env instance.
_DESCRIBED: weakref.WeakKeyDictionary[Any, dict[str, tuple[str, type[pydantic.BaseModel]]]] = (
    weakref.WeakKeyDictionary()
)
_PARAMETERS: weakref.WeakKeyDictionary[type[pydantic.BaseModel], dict[str, Any]] = (
    weakref.WeakKeyDictionary()
)


def _described(fn: ToolFunction, tool_name: str) -> tuple[str, type[pydantic.BaseModel]]:
    """`Tool._describe` of ``fn``, cached per underlying function (a bound method's)."""
    key = getattr(fn, "__func__", fn)
    try:
        by_name = _DESCRIBED.setdefault(key, {})
    except TypeError:  # not weak-referenceable (a builtin): described every time
        return Tool._describe(fn, tool_name)
    found = by_name.get(tool_name)
    if found is None:
        found = by_name[tool_name] = Tool._describe(fn, tool_name)
    return found


def collect_tools(obj: object, extra: list[ToolFunction | Tool] | None = None) -> dict[str, Tool]:
    """Tools from methods of ``obj`` marked with `tool`, plus ``extra`` callables."""
    tools: dict[str, Tool] = {}
    for attr in dir(type(obj)):
        member = getattr(type(obj), attr, None)
        if callable(member) and hasattr(member, "__palaestra_tool__"):
            bound = getattr(obj, attr)
            t = Tool.from_function(bound)
            tools[t.name] = t
    for fn in extra or []:
        t = fn if isinstance(fn, Tool) else Tool.from_function(fn)
        if t.name in tools:
            raise ConfigError(f"two tools are named {t.name!r}; give one another name")
        tools[t.name] = t
    return tools

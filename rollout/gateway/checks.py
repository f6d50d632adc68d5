"""Strict checks of JSON request fields that collect every problem of a request before refusing.

A `Problems` gathers messages that each name the field (``trajectories[2].reward must be a
number, got 'x'``); `Problems.raise_if_any` refuses the request once with all of them. The field
checkers never coerce: ``"5"`` is not an integer, ``17`` is not a string, ``"no"`` is not a
boolean, ``true`` is not a number. They return the value, or None after recording a problem.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping
from typing import Any

from palaestra.errors import PalaestraError, TrajectoryValidationError

MAX_LISTED = 20  # problems spelled out in one refusal; the rest are counted


class _Listed:
    """An error that carries every problem found (``problems``) besides its message."""

    status = 400

    def __init__(self, message: str, problems: tuple[str, ...] = ()) -> None:
        super().__init__(message, tuple(problems))  # type: ignore[call-arg]
        self.message = message
        self.problems = tuple(problems) or (message,)

    def __str__(self) -> str:
        return self.message


class RequestValidationError(_Listed, PalaestraError, ValueError):
    """A request with invalid fields (HTTP 400); ``problems`` lists every one found."""


class InvalidTrajectoryError(_Listed, TrajectoryValidationError):
    """A trajectory post with invalid content (HTTP 422); ``problems`` lists every one found."""

    status = 422


#: the refusals `Problems.raise_if_any` raises
ListedError = type[RequestValidationError] | type[InvalidTrajectoryError]


class Problems:
    """The problems found in one request, in the order found."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, message: str) -> None:
        self.items.append(message)

    def __bool__(self) -> bool:
        return bool(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def message(self, what: str) -> str:
        if len(self.items) == 1:
            return f"{what}: {self.items[0]}"
        shown = self.items[:MAX_LISTED]
        more = len(self.items) - len(shown)
        head = f"{what}: {len(self.items)} problem{'s' if len(self.items) != 1 else ''}"
        tail = f"; and {more} more" if more > 0 else ""
        return f"{head}: " + "; ".join(shown) + tail

    def raise_if_any(self, what: str, error: ListedError = RequestValidationError) -> None:
        """Refuse with every problem at once (``what`` says which request it was)."""
        if self.items:
            raise error(self.message(what), tuple(self.items[:MAX_LISTED]))


def describe(value: Any) -> str:
    """``'x' (a string)``: the value (shortened) and its JSON type, for messages."""
    kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "an object", type(None): "null"}
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({kinds.get(type(value), type(value).__name__)})"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_object(value: Any, where: str, problems: Problems) -> Mapping[str, Any] | None:
    if not isinstance(value, Mapping):
        problems.add(f"{where} must be a JSON object, got {describe(value)}")
        return None
    return value


def unknown_keys(body: Mapping[str, Any], allowed: Collection[str], where: str,
                 problems: Problems) -> None:
    extra = sorted(str(k) for k in body if k not in allowed)
    if extra:
        problems.add(f"{where} has unknown field(s) {extra}; allowed: {sorted(allowed)}")


def check_int(value: Any, where: str, problems: Problems, *, low: int | None = None,
              high: int | None = None) -> int | None:
    """An integer (not a boolean, not a string) in ``[low, high]``."""
    if not is_int(value):
        problems.add(f"{where} must be an integer, got {describe(value)}")
        return None
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = (f"in [{low}, {high}]" if low is not None and high is not None
                  else f">= {low}" if low is not None else f"<= {high}")
        problems.add(f"{where} must be {bounds}, got {value}")
        return None
    return int(value)


def check_number(value: Any, where: str, problems: Problems, *, low: float | None = None,
                 high: float | None = None, low_open: bool = False) -> float | None:
    """A finite number (not a boolean) in its bounds (``low_open``: strictly above ``low``)."""
    if not is_number(value) or not math.isfinite(value):
        problems.add(f"{where} must be a finite number, got {describe(value)}")
        return None
    if low is not None and (value <= low if low_open else value < low):
        problems.add(f"{where} must be {'>' if low_open else '>='} {low}, got {value}")
        return None
    if high is not None and value > high:
        problems.add(f"{where} must be <= {high}, got {value}")
        return None
    return float(value)


def check_bool(value: Any, where: str, problems: Problems) -> bool | None:
    if not isinstance(value, bool):
        problems.add(f"{where} must be true or false, got {describe(value)}")
        return None
    return value


def check_str(value: Any, where: str, problems: Problems, *, max_len: int | None = None,
              nonempty: bool = False) -> str | None:
    if not isinstance(value, str):
        problems.add(f"{where} must be a string, got {describe(value)}")
        return None
    if nonempty and not value:
        problems.add(f"{where} must not be empty")
        return None
    if max_len is not None and len(value) > max_len:
        problems.add(f"{where} has {len(value)} characters; at most {max_len} are allowed")
        return None
    return value


def json_size(value: Any) -> int:
    """Bytes of ``value`` as compact JSON (what a cap on metadata counts)."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False,
                          default=str).encode())


def check_json_bytes(value: Any, where: str, problems: Problems, max_bytes: int | None) -> bool:
    if max_bytes is None:
        return True
    size = json_size(value)
    if size > max_bytes:
        problems.add(f"{where} is {size} bytes as JSON; at most {max_bytes} are allowed "
                     "(keep large artefacts out of the trajectory and send a reference)")
        return False
    return True


__all__ = [
    "MAX_LISTED",
    "InvalidTrajectoryError",
    "Problems",
    "RequestValidationError",
    "check_bool",
    "check_int",
    "check_json_bytes",
    "check_number",
    "check_object",
    "check_str",
    "describe",
    "is_int",
    "is_number",
    "json_size",
    "unknown_keys",
]

"""Exception hierarchy: one base, each subclass also inherits the builtin it replaces.

Every error is picklable (Ray ships them between processes) and its message says how to fix
the problem, not only what went wrong.
"""

from __future__ import annotations


class PalaestraError(Exception):
    """Base class of every error raised by palaestra."""

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        # Exceptions with keyword-only or extra constructor arguments do not round-trip through
        # pickle by default; rebuilding from ``args`` keeps every subclass picklable.
        return (self.__class__, self.args)


class ConfigError(PalaestraError, ValueError):
    """A configuration value is missing, has the wrong type or names something unknown."""


class EnvNotFoundError(PalaestraError, KeyError):
    """An environment id is not registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ToolError(PalaestraError, RuntimeError):
    """A tool call could not be executed; the env turns it into an error tool message."""


class ParseError(PalaestraError, ValueError):
    """Model output could not be parsed (tool call, answer tags, ...)."""


class MissingExtraError(PalaestraError, ImportError):
    """An optional dependency is missing; the message names the extra to install."""

    @classmethod
    def for_module(cls, module: str, extra: str) -> MissingExtraError:
        return cls(
            f"{module!r} is not installed. Install it with: pip install 'palaestra[{extra}]'"
        )


class SandboxError(PalaestraError, RuntimeError):
    """The sandbox could not start or is misconfigured (never raised for a failing program)."""


class EngineError(PalaestraError, RuntimeError):
    """A generation engine failed, is unreachable or answered with an invalid payload."""


class RolloutError(PalaestraError, RuntimeError):
    """A rollout step failed as a whole (e.g. the failure rate crossed its threshold)."""


class TokenDriftError(PalaestraError, AssertionError):
    """Incremental token ids differ from a full re-render (strict drift mode)."""


class CheckpointError(PalaestraError, OSError):
    """A checkpoint is missing, incomplete or incompatible with the run."""


class TrajectoryValidationError(PalaestraError, ValueError):
    """A posted/external trajectory is malformed (lengths, vocabulary, non-finite values)."""


__all__ = [
    "CheckpointError",
    "ConfigError",
    "EngineError",
    "EnvNotFoundError",
    "MissingExtraError",
    "PalaestraError",
    "ParseError",
    "RolloutError",
    "SandboxError",
    "TokenDriftError",
    "ToolError",
    "TrajectoryValidationError",
]

"""Sandbox-specific errors (all subclasses of ``palaestra.errors.SandboxError``)."""

from __future__ import annotations

from palaestra.errors import SandboxError


class IsolationUnavailableError(SandboxError):
    """The requested isolation cannot be set up here; the message says what to install/allow."""


class SandboxFileError(SandboxError):
    """``read_file``/``write_file`` failed (missing file, not a regular file, too large, ...)."""


__all__ = ["IsolationUnavailableError", "SandboxError", "SandboxFileError"]

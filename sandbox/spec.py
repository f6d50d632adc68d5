"""`RunSpec`: one validated execution request, what every sandbox backend receives.

`make_spec` and `spec_for_language` check the caller's code, argv, timeout, stdin and files
(a bad argument is a caller bug: `SandboxError` or `ConfigError` saying what to fix);
`check_relative_path` keeps file names inside the working directory. The backends and the
zygote's request framing import this module, never the `Sandbox` interface in `base`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from palaestra.errors import SandboxError


#: language -> argv prefix that runs the code (python runs in a warm interpreter instead)
SHELL_LANGUAGES: dict[str, tuple[str, ...]] = {"bash": ("bash", "-c"), "sh": ("sh", "-c")}
LANGUAGES: tuple[str, ...] = ("python", *SHELL_LANGUAGES)
MAX_TIMEOUT_S = 24 * 3600.0

FileMap = Mapping[str, "bytes | str"]


@dataclass(frozen=True)
class RunSpec:
    """One validated execution request (what backends receive)."""

    kind: str  # "python" (code in a warm interpreter) or "exec" (argv)
    code: str
    argv: tuple[str, ...]
    timeout: float
    stdin: bytes | None
    files: tuple[tuple[str, bytes], ...]


def check_relative_path(path: str) -> str:
    """A normalised relative path inside the workspace, or SandboxError saying why not."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise SandboxError(f"bad file name {path!r}: use a non-empty relative path")
    parts = [p for p in path.replace("\\", "/").split("/") if p not in ("", ".")]
    if path.startswith("/") or not parts or any(p == ".." for p in parts):
        raise SandboxError(f"bad file name {path!r}: use a relative path inside the workspace "
                           "(no leading '/', no '..')")
    return "/".join(parts)


def as_bytes(data: bytes | str, what: str) -> bytes:
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise SandboxError(f"{what} must be bytes or str, got {type(data).__name__}")


def make_spec(kind: str, code: str, argv: Sequence[str], timeout: float,
              stdin: bytes | str | None, files: FileMap | None) -> RunSpec:
    """Validate the arguments of run/run_command (raises SandboxError for caller mistakes)."""
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or \
            not math.isfinite(timeout) or not 0 < timeout <= MAX_TIMEOUT_S:
        raise SandboxError(f"timeout must be a number of seconds in (0, {MAX_TIMEOUT_S:.0f}], "
                           f"got {timeout!r}")
    if kind == "python" and not isinstance(code, str):
        raise SandboxError(f"code must be a str, got {type(code).__name__}")
    if kind == "exec":
        if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
            raise SandboxError(f"argv must be a non-empty list of strings, got {argv!r}")
        if any("\x00" in a for a in argv):
            raise SandboxError("argv entries cannot contain NUL bytes")
    items: list[tuple[str, bytes]] = []
    if files is not None:
        if not isinstance(files, Mapping):
            raise SandboxError(f"files must be a mapping name -> bytes, got {type(files).__name__}")
        for name, data in files.items():
            items.append((check_relative_path(name), as_bytes(data, f"files[{name!r}]")))
    raw_stdin = None if stdin is None else as_bytes(stdin, "stdin")
    return RunSpec(kind=kind, code=code, argv=tuple(argv), timeout=float(timeout),
                   stdin=raw_stdin, files=tuple(items))


def spec_for_language(code: str, language: str, timeout: float, stdin: bytes | str | None,
                      files: FileMap | None) -> RunSpec:
    if language == "python":
        return make_spec("python", code, (), timeout, stdin, files)
    if language in SHELL_LANGUAGES:
        if not isinstance(code, str):
            raise SandboxError(f"code must be a str, got {type(code).__name__}")
        return make_spec("exec", code, (*SHELL_LANGUAGES[language], code), timeout, stdin, files)
    raise SandboxError(f"unsupported language {language!r}; choose one of {', '.join(LANGUAGES)} "
                       "(or use run_command(argv) for anything else)")


__all__ = ["LANGUAGES", "MAX_TIMEOUT_S", "SHELL_LANGUAGES", "FileMap", "RunSpec",
           "as_bytes", "check_relative_path", "make_spec", "spec_for_language"]

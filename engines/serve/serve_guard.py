"""What guards `palaestra serve`: its options, API keys, body limits and the loopback warning.

Keys are sent as OpenAI and SGLang clients send them, ``Authorization: Bearer KEY``. With
``--api-key`` every route but ``/health*`` needs it; with ``--admin-api-key`` the routes that
change the server for everyone (weights, weight groups, caches, memory, pause and abort) need the
admin key, which also opens the other routes. Without keys the server is open, which is only safe
on loopback: `exposure_warning` says so when it binds anywhere else. Bodies are read with a limit
in megabytes (``/update_weights_from_tensor`` has its own, larger one: it carries weights).
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from palaestra.errors import ConfigError
from palaestra.engines.serve.serve_requests import BadRequest, ServeLimits

if TYPE_CHECKING:
    from aiohttp import web

#: Routes that change the server for every client: they take the admin key when one is set.
ADMIN_PATHS = frozenset({
    "/update_weights_from_disk", "/update_weights_from_tensor", "/update_weights_from_distributed",
    "/init_weights_update_group", "/destroy_weights_update_group", "/update_weight_version",
    "/get_weights_by_name", "/pause_generation", "/continue_generation", "/abort_request",
    "/flush_cache", "/release_memory_occupation", "/resume_memory_occupation",
})
#: Routes open to anyone (liveness probes, as SGLang exempts them).
OPEN_PATHS = frozenset({"/health", "/health_generate"})
WEIGHTS_BODY_PATHS = frozenset({"/update_weights_from_tensor"})


@dataclass(frozen=True)
class ServeOptions:
    """Everything `palaestra serve` enforces beyond SGLang's schemas (see the CLI's help)."""

    limits: ServeLimits = field(default_factory=ServeLimits)
    api_key: str | None = None
    admin_api_key: str | None = None
    max_body_mb: float = 32.0
    max_weights_body_mb: float = 4096.0
    shutdown_grace_s: float = 5.0  #: in-flight requests may finish this long after SIGTERM
    weight_group_timeout_s: float = 120.0  #: rendezvous and each broadcast of a weight group
    weight_group_connect_timeout_s: float = 10.0  #: until the trainer's store must answer

    def __post_init__(self) -> None:
        problems = [f"{name} must be > 0" for name in (
            "max_body_mb", "max_weights_body_mb", "weight_group_timeout_s",
            "weight_group_connect_timeout_s") if not getattr(self, name) > 0]
        if self.shutdown_grace_s < 0:
            problems.append("shutdown_grace_s must be >= 0")
        for name in ("api_key", "admin_api_key"):
            key = getattr(self, name)
            if key is not None and (not key or any(c.isspace() for c in key)):
                problems.append(f"{name} must be a non-empty string without whitespace")
        if problems:
            raise ConfigError("invalid serve options: " + "; ".join(problems))

    def body_limit(self, path: str) -> int:
        mb = self.max_weights_body_mb if path in WEIGHTS_BODY_PATHS else self.max_body_mb
        return int(mb * (1 << 20))


def bearer(request: web.Request) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header (None without one)."""
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


def _same(a: str | None, b: str) -> bool:
    return a is not None and hmac.compare_digest(a.encode(), b.encode())


def refusal(options: ServeOptions, path: str, key: str | None) -> tuple[int, str, str] | None:
    """(status, message, code) when ``key`` may not call ``path``; None when it may."""
    if path in OPEN_PATHS:
        return None
    admin = options.admin_api_key
    if path in ADMIN_PATHS and admin is not None:
        if _same(key, admin):
            return None
        return (401 if key is None else 403,
                (f"{path} needs the server's admin key (palaestra serve --admin-api-key), sent "
                "as 'Authorization: Bearer KEY'."), "invalid_api_key")
    if options.api_key is None or _same(key, options.api_key) or (
            admin is not None and _same(key, admin)):
        return None
    return (401, ("Incorrect or missing API key: send the server's --api-key as 'Authorization: "
            "Bearer KEY'."), "invalid_api_key")


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server on this machine ("" and 0.0.0.0 do not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, options: ServeOptions) -> str | None:
    """A warning for a server reachable beyond this machine without (admin) keys."""
    if is_loopback(host):
        return None
    missing = [flag for flag, key in (("--api-key", options.api_key),
                                      ("--admin-api-key", options.admin_api_key)) if key is None]
    if not missing:
        return None
    if missing == ["--api-key"]:
        what = "anyone who can reach it may generate"
    elif options.api_key is not None:
        what = "whoever has the API key may also swap the weights and abort other clients"
    else:
        what = ("anyone who can reach it may generate, swap the weights, pause the engine and "
                "abort requests")
    return (f"palaestra serve binds {host}, beyond loopback, without {' or '.join(missing)}: "
            f"{what}. Set the key(s), or bind 127.0.0.1.")


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it exceeds ``limit`` bytes."""
    declared = request.content_length
    mb = limit / (1 << 20)
    too_large = BadRequest(f"the request body is larger than this server's limit of {mb:g} MB "
                           "(palaestra serve --max-body-mb).", None, "request_too_large", 413)
    if declared is not None and declared > limit:
        raise too_large
    if declared is not None:  # the common case: aiohttp reads exactly that many bytes
        return await request.read()
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


__all__ = [
    "ADMIN_PATHS",
    "OPEN_PATHS",
    "ServeOptions",
    "bearer",
    "exposure_warning",
    "is_loopback",
    "read_body",
    "refusal",
]

"""API keys of the gateway: ``Authorization: Bearer <key>``, as OpenAI and SGLang clients send it.

The rule is SGLang's (``--api-key`` / ``--admin-api-key``):

- ``/health`` is always open (load balancers and supervisors poll it);
- admin routes (`ADMIN_ROUTES`: handing trajectories to trainers) need the admin key when one is
  set, else the API key when one is set, else nothing;
- every other route needs the API key when one is set (the admin key does not open them).

Keys are compared in constant time. `GatewayKeys.warn_if_open` says so when a gateway binds
beyond loopback without keys.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass

ADMIN_ROUTES = frozenset({"/trajectories/take", "/trajectories/claim"})
OPEN_ROUTES = frozenset({"/health"})


def bearer_token(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (None when absent or malformed)."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class GatewayKeys:
    """The API key and the admin key of a gateway (None: that level is open)."""

    api_key: str | None = None
    admin_api_key: str | None = None

    def required(self, path: str) -> str | None:
        """The key a request to ``path`` must carry (None: none needed)."""
        if path in OPEN_ROUTES:
            return None
        if path in ADMIN_ROUTES:
            return self.admin_api_key or self.api_key
        return self.api_key

    def allows(self, path: str, authorization: str | None) -> bool:
        key = self.required(path)
        if key is None:
            return True
        token = bearer_token(authorization)
        return token is not None and hmac.compare_digest(token.encode(), key.encode())

    def warning(self, host: str) -> str | None:
        """A warning when the gateway listens beyond loopback with a level left open."""
        if is_loopback(host):
            return None
        if self.api_key is None:
            return (f"warning: the gateway listens on {host} without --api-key: any host that "
                    "reaches it can open sessions, sample from the policy and post trajectories")
        return None


__all__ = ["ADMIN_ROUTES", "OPEN_ROUTES", "GatewayKeys", "bearer_token", "is_loopback"]

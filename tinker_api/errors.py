"""The errors a request can end in: an HTTP status and a message that names the reason.

`ApiError` is raised by validation and by the handlers; the app's middleware turns it into a
JSON 4xx answer (``{"error": ..., "detail": ...}``), and a future that fails with it resolves to
the SDK's ``RequestFailedResponse`` with the ``user`` category. Statuses are 400, 404 and 410
only: the SDK retries 408, 409, 429 and 5xx for minutes, which would hide the reason.
"""

from __future__ import annotations

from palaestra.errors import PalaestraError


class ApiError(PalaestraError):
    """A refused request: ``status`` (400 bad input or not served, 404 unknown id or route,
    410 finished session) and a message that says what to change."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def not_found(what: str, name: str, known: list[str] | None = None) -> ApiError:
    """404 for an unknown id, listing a few known ones."""
    hint = f" (known: {', '.join(known[:5])})" if known else ""
    return ApiError(f"unknown {what} {name!r}{hint}", status=404)


def not_served(feature: str, why: str) -> ApiError:
    """400 for a feature of the Tinker API this server does not implement."""
    return ApiError(f"{feature} is not served by palaestra tinker-server: {why}", status=400)


__all__ = ["ApiError", "not_found", "not_served"]

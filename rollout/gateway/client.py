"""`TrajectoryClient`: post finished trajectories to a rollout buffer server from anywhere.

    from palaestra.rollout.gateway import TrajectoryClient

    client = TrajectoryClient("http://trainer-host:8900")
    client.post([{"token_ids": ids, "loss_mask": mask, "logprobs": lps, "reward": 1.0}],
                group_id="q17", group_size=4)

Trajectories are wire dicts (see `palaestra.rollout.gateway.validation`) or `Trajectory` objects.
`post` is synchronous (standard library only, for generator processes without an event loop);
`apost` is its asyncio twin. A refused post raises `TrajectoryValidationError` with the server's
reason; an unreachable server raises `RolloutError`. ``api_key`` is sent as
``Authorization: Bearer <key>`` (a gateway started with ``--api-key``; taking groups needs its
admin key when it has one).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from palaestra.errors import RolloutError, TrajectoryValidationError
from palaestra.rollout.gateway.wire import trajectory_to_wire
from palaestra.rollout.groups import GroupResult
from palaestra.types import Trajectory


class TrajectoryClient:
    """Client of ``POST /trajectories`` on a gateway / rollout buffer server."""

    def __init__(self, url: str, *, timeout_s: float = 60.0, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.api_key = api_key

    @property
    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    @staticmethod
    def payload(
        trajectories: Sequence[Trajectory | Mapping[str, Any]],
        *,
        group_id: str | None = None,
        group_size: int | None = None,
    ) -> dict[str, Any]:
        """The JSON body of a post."""
        items = [trajectory_to_wire(t) if isinstance(t, Trajectory) else dict(t)
                 for t in trajectories]
        if group_id is not None:
            for item in items:
                if not item.get("group_id"):
                    item["group_id"] = group_id
        body: dict[str, Any] = {"trajectories": items}
        if group_id is not None:
            body["group_id"] = group_id
        if group_size is not None:
            body["group_size"] = group_size
        return body

    def post(
        self,
        trajectories: Sequence[Trajectory | Mapping[str, Any]],
        *,
        group_id: str | None = None,
        group_size: int | None = None,
    ) -> dict[str, Any]:
        """Post trajectories; returns the server's receipt (accepted count, group states)."""
        return self._call("/trajectories", self.payload(
            trajectories, group_id=group_id, group_size=group_size))

    def take(self, max_groups: int | None = None) -> list[GroupResult]:
        """Complete groups from a buffer server (removed there), as `GroupResult`s."""
        from palaestra.rollout.gateway.validation import parse_trajectory

        body = self._call("/trajectories/take", {"max_groups": max_groups})
        return [
            GroupResult(g["group_id"], tuple(
                parse_trajectory(t, f"groups[{i}]", g["group_id"], vocab_size=None, version=0)
                for t in g["trajectories"]), -1)
            for i, g in enumerate(body["groups"])
        ]

    def _call(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.url}{path}", data=json.dumps(body).encode(), method="POST",
            headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                return dict(json.loads(resp.read()))
        except urllib.error.HTTPError as exc:
            raise _refusal(exc.code, exc.read()) from None
        except (urllib.error.URLError, OSError) as exc:
            raise RolloutError(f"cannot reach the trajectory buffer at {self.url}: {exc}") from exc

    async def apost(
        self,
        trajectories: Sequence[Trajectory | Mapping[str, Any]],
        *,
        group_id: str | None = None,
        group_size: int | None = None,
    ) -> dict[str, Any]:
        """`post` for asyncio code."""
        import aiohttp

        body = self.payload(trajectories, group_id=group_id, group_size=group_size)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as http, http.post(
                f"{self.url}/trajectories", data=json.dumps(body), headers=self.headers,
            ) as resp:
                raw = await resp.read()
                if resp.status >= 400:
                    raise _refusal(resp.status, raw)
                return dict(json.loads(raw))
        except aiohttp.ClientError as exc:
            raise RolloutError(f"cannot reach the trajectory buffer at {self.url}: {exc}") from exc


def _refusal(status: int, raw: bytes) -> Exception:
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw.decode(errors="replace")[:500]
    if 400 <= status < 500:
        error = TrajectoryValidationError(f"HTTP {status}: {message}")
        error.status = status  # type: ignore[attr-defined]
        return error
    return RolloutError(f"the trajectory buffer failed (HTTP {status}): {message}")


__all__ = ["TrajectoryClient"]

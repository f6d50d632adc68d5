"""Posted trajectories as rollout groups: `BufferSource` and the external env.

`BufferSource` is a data source for `RolloutManager` (the same ``next``/``exhausted``/
``state_dict`` interface as `palaestra.rollout.data.DataSource`): every complete group of a
`TrajectoryBuffer` becomes one task of the env ``palaestra-gateway/External-v0``, optionally
ahead of the tasks of a regular source (``then=``), so posted groups and generated groups share
batches. A rollout worker plays that task like any other; the env's kind
(``EpisodeKind.POSTED``) has `run_external_episode` for its runner, which claims one posted trajectory of the group per episode, in process by
the buffer's name or over HTTP (``POST /trajectories/claim``) when the worker runs elsewhere.
The manager then judges, filters, batches and accounts for these groups exactly as for its own.

The manager's ``group_size`` must equal the buffer's (each episode of the task claims one
trajectory); `BufferSource` checks it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

from palaestra.envs.base import Env, StepResult
from palaestra.episode_info import EpisodeKind
from palaestra.errors import ConfigError, TrajectoryValidationError
from palaestra.rollout.data import DataSource, TaskItem
from palaestra.rollout.episode import EpisodeRequest, failed_trajectory
from palaestra.rollout.gateway.buffer import TrajectoryBuffer
from palaestra.types import Message, Trajectory

EXTERNAL_ENV_ID = "palaestra-gateway/External-v0"
#: what a task row names to reach the external env from any process (make() imports the module)
EXTERNAL_ENV = f"palaestra.rollout.gateway.external:{EXTERNAL_ENV_ID}"


class ExternalEnv(Env):
    """Hands out trajectories posted to a `TrajectoryBuffer` (see the module docstring)."""

    episode_kind: ClassVar[EpisodeKind] = EpisodeKind.POSTED
    step_in_thread: ClassVar[bool] = False

    def __init__(self, buffer: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.buffer = buffer

    def initial_messages(self, task: Mapping[str, Any]) -> Sequence[Message]:
        return [Message("user", json.dumps(dict(task), sort_keys=True))]

    def on_action(self, action: Message) -> StepResult:
        raise ConfigError("the external env replays posted trajectories; it cannot be stepped")


#: registered by `palaestra.envs.registry.lookup` when a task names ``EXTERNAL_ENV``
PALAESTRA_ENVS = {EXTERNAL_ENV_ID: "palaestra.rollout.gateway.external:ExternalEnv"}


class BufferSource:
    """Complete groups of a buffer as rollout tasks, then (optionally) another source's tasks.

    ``address`` is how workers reach the buffer: its registered name (in-process workers,
    ``cluster="local"``) or the URL of its server (Ray workers). The source never runs out while
    the buffer is open; `close` ends it once the buffer (and ``then``) are drained.
    """

    def __init__(self, buffer: TrajectoryBuffer, *, group_size: int, address: str | None = None,
                 then: DataSource | None = None) -> None:
        if buffer.group_size != group_size:
            raise ConfigError(
                f"the buffer's group_size ({buffer.group_size}) must equal the rollout's "
                f"group_size ({group_size}): each episode of a task claims one trajectory")
        address = address or buffer.name
        if not address:
            raise ConfigError("give the buffer a name (TrajectoryBuffer(name=...)) or pass "
                              "address= (the URL of its server, for Ray workers)")
        self.buffer = buffer
        self.group_size = group_size
        self.address = address
        self.then = then
        self.closed = False
        self.drawn = 0

    def close(self) -> None:
        """No more posts are expected: the source is exhausted once the buffer is drained."""
        self.closed = True

    def __len__(self) -> int:
        return len(self.then) if self.then is not None else 0

    @property
    def exhausted(self) -> bool:
        rest = self.then is None or self.then.exhausted
        return self.closed and rest and self.buffer.ready_count() == 0

    def next(self) -> TaskItem | None:
        reserved = self.buffer.reserve()
        if reserved is not None:
            gid, _ = reserved
            self.drawn += 1
            return TaskItem(EXTERNAL_ENV, {"external_group": gid, "buffer": self.address}, gid,
                            index=-1, epoch=0, seed=self.drawn)
        if self.then is not None:
            return self.then.next()
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"then": self.then.state_dict() if self.then is not None else None,
                "drawn": self.drawn}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.then is not None and state.get("then") is not None:
            self.then.load_state_dict(state["then"])
        self.drawn = int(state.get("drawn", 0))


async def run_external_episode(request: EpisodeRequest) -> Trajectory:
    """One posted trajectory of the task's group, under the rollout's group id; never raises."""
    task = dict(request.task or {})
    group_id = request.group_id
    gid = str(task.get("external_group", ""))
    env = request.env  # the runner of EpisodeKind.POSTED: an ExternalEnv
    address = str(task.get("buffer") or (env.buffer if isinstance(env, ExternalEnv) else "")
                  or "")
    try:
        if not gid or not address:
            raise ConfigError("an external task needs 'external_group' and 'buffer'")
        if address.startswith(("http://", "https://")):
            traj = await _claim_http(address, gid)
        else:
            traj = TrajectoryBuffer.named(address).claim(gid)
    except Exception as exc:  # noqa: BLE001 - a bad rollout is data, not a crash
        failed = replace(request, env_id=request.env_id or EXTERNAL_ENV_ID)
        return failed_trajectory(failed, f"external: {type(exc).__name__}: {exc}", gid)
    samples = tuple(replace(s, group_id=group_id) for s in traj.samples)
    return replace(traj, samples=samples, group_id=group_id, task_id=traj.task_id or gid)


async def _claim_http(url: str, group_id: str) -> Trajectory:
    """Claim over HTTP; a gateway with keys gets ``PALAESTRA_ADMIN_API_KEY`` (else
    ``PALAESTRA_API_KEY``) of this process as its Bearer token."""
    import os

    import aiohttp

    from palaestra.rollout.gateway.validation import parse_trajectory

    key = os.environ.get("PALAESTRA_ADMIN_API_KEY") or os.environ.get("PALAESTRA_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as http, http.post(
        f"{url.rstrip('/')}/trajectories/claim", json={"group_id": group_id}, headers=headers
    ) as resp:
        body = await resp.json(content_type=None)
        if resp.status >= 400:
            raise TrajectoryValidationError(f"claim of {group_id!r} refused: {body}")
    return parse_trajectory(body, "claimed", group_id, vocab_size=None, version=0)


__all__ = ["EXTERNAL_ENV", "EXTERNAL_ENV_ID", "BufferSource", "ExternalEnv",
           "run_external_episode"]

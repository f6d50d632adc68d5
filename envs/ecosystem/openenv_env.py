"""`OpenEnvEnv` (``ecosystem/OpenEnv-v0``): an OpenEnv environment server as a palaestra env.

    env = palaestra.envs.make("palaestra.envs.ecosystem:ecosystem/OpenEnv-v0", url="http://127.0.0.1:8000",
                              action_field="message", observation_field="echoed_message")

Talks OpenEnv's environment API through ``openenv-core``'s own client
(``pip install 'palaestra[openenv]'``): `GenericEnvClient` opens one WebSocket session per
episode (the server keeps the episode's state for that session), ``reset(seed=...)`` at
palaestra's reset, ``step(action)`` per assistant message, ``state()`` on demand
(`server_state`). The server is started by the user (a container, ``uvicorn``, ``openenv
serve``); the adapter only connects.

Actions: the assistant's text becomes ``{action_field: text}`` (default ``"message"``); with
``action_field=None`` the text must be a JSON object, sent as the action (a malformed one is
answered with an error message, and ``max_consecutive_errors`` of them end the episode).
Observations: the server's observation dict, shown to the model as ``observation_field``'s
value when given, else as JSON (without ``done``, ``reward`` and empty ``metadata``); the step
reward is the server's ``reward`` (None: 0) and ``done`` ends the episode. A server that drops
the connection or does not answer within ``timeout_s`` ends the episode with stop reason
``error``/``timeout``. Task rows (optional) carry ``reset`` kwargs for the server and an
optional ``prompt`` shown before the first observation.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from palaestra.asyncio_utils import run_sync
from palaestra.envs.base import Env, MultiTurnEnv, StepResult
from palaestra.envs.ecosystem.background import on_background
from palaestra.errors import ConfigError, MissingExtraError, ToolError
from palaestra.types import Message, StopReason

DEFAULT_SYSTEM_PROMPT = (
    "You are acting in an environment. Each user message is its latest observation; reply with "
    "your next action."
)
_HIDDEN = ("done", "reward")


def _client_class() -> Any:
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError:
        raise MissingExtraError.for_module("openenv-core", "openenv") from None
    return GenericEnvClient


class OpenEnvEnv(MultiTurnEnv):
    """An OpenEnv HTTP/WebSocket environment server, one session per episode."""

    step_in_thread: ClassVar[bool] = False  # IO goes to the background loop, never blocks
    tool_call_format: ClassVar[str] = "none"  # actions are the text itself
    snapshot_exclude: ClassVar[tuple[str, ...]] = ("_dataset", "_client")

    def __init__(
        self,
        *,
        url: str,
        action_field: str | None = "message",
        observation_field: str | None = None,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        timeout_s: float = 60.0,
        max_turns: int = 16,
        max_consecutive_errors: int = 3,
        tasks: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ConfigError(f"url must be the server's address, e.g. http://127.0.0.1:8000, got {url!r}")
        if tasks is not None:
            kwargs["dataset"] = [dict(t) for t in tasks]
        super().__init__(max_turns=max_turns, **kwargs)
        self.url = url.rstrip("/")
        self.action_field = action_field
        self.observation_field = observation_field
        self.system_prompt = system_prompt
        self.timeout_s = timeout_s
        self.max_consecutive_errors = max_consecutive_errors
        self.consecutive_errors = 0
        self._client: Any = None
        self._shares_client = False
        self.last_observation: dict[str, Any] = {}

    # ----- session -------------------------------------------------------------------------
    async def _open(self) -> Any:
        client = _client_class()(base_url=self.url, message_timeout_s=self.timeout_s)
        await asyncio.wait_for(client.connect(), self.timeout_s)
        return client

    async def server_state(self) -> dict[str, Any]:
        """The server's ``state()`` of this episode (e.g. ``episode_id``, ``step_count``)."""
        if self._client is None:
            raise ToolError("no OpenEnv session: call reset() first")
        state = await on_background(asyncio.wait_for(self._client.state(), self.timeout_s))
        return dict(state)

    # ----- episode -------------------------------------------------------------------------
    def sample_task(self, rng: np.random.Generator) -> dict[str, Any]:
        if self._dataset is not None:
            return super().sample_task(rng)
        seed = int(rng.integers(2**31 - 1))
        return {"id": f"openenv-{seed}", "reset": {"seed": seed}}

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[tuple[Message, ...], dict[str, Any]]:
        return run_sync(self.areset(seed=seed, options=options))

    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[tuple[Message, ...], dict[str, Any]]:
        await self._end_session()
        self.closed = False
        self.consecutive_errors = 0
        Env.reset(self, seed=seed, options=options)  # draws the task; the messages come below
        assert self.task is not None
        reset_kwargs = dict(self.task.get("reset") or {})
        self._client = await on_background(self._open())
        result = await on_background(
            asyncio.wait_for(self._client.reset(**reset_kwargs), self.timeout_s))
        self.last_observation = dict(result.observation or {})
        messages = [Message(role="system", content=self.system_prompt)]
        if self.task.get("prompt"):
            messages.append(Message(role="user", content=str(self.task["prompt"])))
        messages.append(Message(role="user", content=self._render(self.last_observation)))
        observation = tuple(messages)
        self.history = list(observation)
        info = {"task_id": str(self.task.get("id", "")), "tools": []}
        return observation, info

    def initial_messages(self, task: Mapping[str, Any]) -> Sequence[Message]:
        return ()  # areset builds them from the server's first observation

    def on_action(self, action: Message) -> StepResult:
        return run_sync(self.aon_action(action))

    async def aon_action(self, action: Message) -> StepResult:
        payload = self._action(action.content)
        if isinstance(payload, str):  # not a valid action: say why, count it
            self.consecutive_errors += 1
            stop = self.consecutive_errors >= self.max_consecutive_errors
            return StepResult(observation=[Message(role="user", content=payload)], terminated=stop,
                              info={"action_error": payload},
                              stop_reason=StopReason.PARSE_ERROR if stop else None)
        self.consecutive_errors = 0
        if self._client is None:
            raise ToolError("no OpenEnv session: call reset() first")
        try:
            result = await on_background(
                asyncio.wait_for(self._client.step(payload), self.timeout_s))
        except asyncio.TimeoutError:
            return self._failed(f"the OpenEnv server {self.url} did not answer within "
                                f"{self.timeout_s:g} s", StopReason.TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - a dead server is a failed episode
            return self._failed(f"the OpenEnv server {self.url} failed: {type(exc).__name__}: "
                                f"{exc}", StopReason.ERROR)
        self.last_observation = dict(result.observation or {})
        reward = float(result.reward) if result.reward is not None else 0.0
        return StepResult(observation=[Message(role="user", content=self._render(self.last_observation))],
                          reward=reward, terminated=bool(result.done),
                          info={"server_reward": result.reward})

    def _failed(self, why: str, stop: StopReason) -> StepResult:
        return StepResult(observation=[Message(role="user", content=f"Error: {why}")],
                          terminated=True, info={"error": why}, stop_reason=stop)

    def _action(self, text: str) -> dict[str, Any] | str:
        if self.action_field is not None:
            return {self.action_field: text}
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"Error: the action must be a JSON object ({exc.msg} at position {exc.pos})"
        if not isinstance(value, dict):
            return f"Error: the action must be a JSON object, got {type(value).__name__}"
        return value

    def _render(self, observation: Mapping[str, Any]) -> str:
        if self.observation_field is not None and self.observation_field in observation:
            return str(observation[self.observation_field])
        shown = {k: v for k, v in observation.items()
                 if k not in _HIDDEN and not (k == "metadata" and not v)}
        return json.dumps(shown, ensure_ascii=False, sort_keys=True, default=str)

    def fork(self) -> OpenEnvEnv:
        """A copy at this point of the episode. A server's episode cannot be forked, so the copy
        steps the same server session (its moves change the original's server state too) and
        leaves the session open when closed; its next reset opens a session of its own."""
        clone = copy.copy(self)
        clone.__dict__ = dict(self.__dict__)
        clone.restore(self.snapshot())
        clone._shares_client = True
        return clone

    async def _end_session(self) -> None:
        client, self._client = self._client, None
        shared, self._shares_client = self._shares_client, False
        if client is not None and not shared:
            try:
                await on_background(asyncio.wait_for(client.close(), 10))
            except Exception:  # noqa: BLE001, S110 - the server may already be gone
                pass

    def close(self) -> None:
        if self._client is not None:
            run_sync(self._end_session())
        super().close()

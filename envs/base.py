"""The message-level environment contract: `Env` (gymnasium) and `MultiTurnEnv`.

Observation = the *new* chat messages of a step (a tuple of `Message`); action = one assistant
`Message`, an OpenAI message dict, or plain text. Text is parsed with the env's tool-call format
(``tool_call_format``: Hermes/Qwen ``<tool_call>{json}</tool_call>`` by default, set per env class
or with the ``tool_call_format=`` constructor argument; see `palaestra.tool_parsers`), the parser
agents use for sampled text, so ``env.step('<tool_call>...</tool_call>')`` runs the tool as the
rollout would; text without a tool call is an answer. The rollout loop
awaits the async twins `areset`/`astep`; by default they run the sync methods in a thread (set
``step_in_thread = False`` for envs whose steps are cheap and non-blocking, or override
`aon_action` for IO-bound envs).

Tasks: ``reset(seed=..., options={"task": row})`` sets the task explicitly (``row`` is a dict in
the env's dataset format); without a task the env draws one from its dataset with the seed.
The same seed and task give the same episode.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import gymnasium
import numpy as np

from palaestra.envs.spaces import AssistantMessageSpace, MessagesSpace
from palaestra.episode_info import EpisodeKind, ResetInfo, StepInfo
from palaestra.errors import ConfigError
from palaestra.tool_parsers import Parser, get_parser, number_calls
from palaestra.types import Message, StopReason, as_message

Observation = tuple[Message, ...]


@dataclass
class StepResult:
    """What an env returns for one action before the gymnasium bookkeeping is added.

    ``info`` holds the env's own keys; the fields the framework reads are typed here (None: not
    reported) and become the step's `palaestra.episode_info.StepInfo`.
    """

    observation: Sequence[Message] = ()
    reward: float = 0.0
    terminated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    stop_reason: StopReason | None = None
    tool_calls: int | None = None
    tool_errors: int | None = None
    sandbox_s: float | None = None
    final_reward: float | None = None


def task_id_of(task: Mapping[str, Any]) -> str:
    """A stable id for a task row: its own id field, else a hash of its content."""
    for key in ("task_id", "id", "_id", "qid"):
        if key in task and task[key] is not None:
            return str(task[key])
    blob = json.dumps(task, sort_keys=True, default=str).encode()
    return hashlib.sha1(blob).hexdigest()[:16]


class Env(gymnasium.Env[Observation, Message]):
    """Base class of palaestra environments (gymnasium API over chat messages).

    Subclasses implement `initial_messages` and `on_action`, and provide tasks either through a
    dataset (``dataset=[rows]`` or by overriding `load_dataset`) or by overriding `sample_task`.
    """

    metadata: dict[str, Any] = {"render_modes": ["ansi"]}  # gymnasium's (class-level default)
    #: How the rollout plays this env's episodes (stepped by its own loop unless said otherwise).
    episode_kind: ClassVar[EpisodeKind] = EpisodeKind.STEPPED
    #: Run `on_action` in a worker thread from `astep` (False for cheap, non-blocking steps).
    step_in_thread: ClassVar[bool] = True
    #: Instance attributes left out of `snapshot` (shared resources: retrievers, sandboxes).
    snapshot_exclude: ClassVar[tuple[str, ...]] = ("_dataset",)
    #: How text actions are parsed (`palaestra.tool_parsers` names; "none": text is content only).
    tool_call_format: ClassVar[str] = "hermes"
    #: Fields a task row must carry for ``reset(options={"task": row})``; a tuple entry is met by
    #: any one of its names. Training configs check their data files against it at load time.
    task_fields: ClassVar[tuple[str | tuple[str, ...], ...]] = ()

    def __init__(
        self,
        *,
        dataset: Sequence[Mapping[str, Any]] | None = None,
        max_turns: int = 1,
        render_mode: str | None = None,
        tool_call_format: str | None = None,
    ) -> None:
        if max_turns < 1:
            raise ConfigError(f"max_turns must be >= 1, got {max_turns}")
        if render_mode not in (None, "ansi"):
            raise ConfigError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.observation_space = MessagesSpace()
        self.action_space = AssistantMessageSpace()
        self.render_mode = render_mode
        self.max_turns = max_turns
        self.text_parser = _text_parser(tool_call_format or type(self).tool_call_format)
        self._dataset = list(dataset) if dataset is not None else None
        self.task: dict[str, Any] | None = None
        self.turn = 0
        self.history: list[Message] = []
        self.done = False
        self.closed = False

    # ----- to implement -------------------------------------------------------------------
    def initial_messages(self, task: Mapping[str, Any]) -> Sequence[Message]:
        """The first observation for ``task`` (system prompt and user question)."""
        raise NotImplementedError(f"{type(self).__name__} must implement initial_messages()")

    def on_action(self, action: Message) -> StepResult:
        """React to one assistant message: new messages, reward, whether the episode ended."""
        raise NotImplementedError(f"{type(self).__name__} must implement on_action()")

    async def aon_action(self, action: Message) -> StepResult:
        """Async twin of `on_action`; IO-bound envs override this one."""
        if self.step_in_thread:
            return await asyncio.to_thread(self.on_action, action)
        return self.on_action(action)

    def load_dataset(self) -> Sequence[Mapping[str, Any]]:
        """Task rows for draws without an explicit task (override to load lazily from disk)."""
        raise ConfigError(
            f"{type(self).__name__} has no dataset: pass dataset=[...] to the constructor or "
            "reset(options={'task': row}) with an explicit task row"
        )

    def sample_task(self, rng: np.random.Generator) -> dict[str, Any]:
        rows = self.dataset
        if not rows:
            raise ConfigError(f"{type(self).__name__}: the dataset is empty")
        return dict(rows[int(rng.integers(len(rows)))])

    def tool_schemas(self) -> list[dict[str, Any]]:
        """OpenAI function schemas of the tools this env offers (none by default)."""
        return []

    def message_from_text(self, text: str) -> Message:
        """The assistant message of a text action: its tool calls parsed with the env's format.

        Calls get ids ``call_<turn>_<i>`` (unique in the episode), as the agents give them.
        """
        parser = getattr(self, "text_parser", None)
        if parser is None:
            return Message(role="assistant", content=text)
        return number_calls(parser.parse(text), self.turn)

    @classmethod
    def task_problems(cls, task: Mapping[str, Any]) -> list[str]:
        """Why ``task`` cannot start an episode (empty: it can), without building the env;
        the default checks `task_fields`."""
        missing = []
        for entry in cls.task_fields:
            names = (entry,) if isinstance(entry, str) else entry
            if all(task.get(name) is None for name in names):
                missing.append(" or ".join(repr(name) for name in names))
        return [f"missing {', '.join(missing)}"] if missing else []

    # ----- gymnasium API ------------------------------------------------------------------
    #: a reset's seed whose generator is not built yet (see `_seed_lazily`)
    _pending_seed: int | None = None

    def _seed_lazily(self, seed: int | None) -> None:
        """gymnasium's ``reset(seed=...)``, with the generator built when first used: a task
        row given in ``options`` never draws from it, and building one costs ~0.1 ms a reset."""
        if seed is None:
            return
        if type(seed) is not int or seed < 0:
            super().reset(seed=seed)  # gymnasium's own check and error
            return
        self._np_random = None
        self._pending_seed = seed

    @property
    def np_random(self) -> np.random.Generator:
        """The env's generator (gymnasium's), seeded by the last reset's seed."""
        if self._pending_seed is not None:
            from gymnasium.utils import seeding

            self._np_random, self._np_random_seed = seeding.np_random(self._pending_seed)
            self._pending_seed = None
        return gymnasium.Env.np_random.fget(self)  # type: ignore[attr-defined]

    @np_random.setter
    def np_random(self, value: np.random.Generator) -> None:
        self._pending_seed = None
        gymnasium.Env.np_random.fset(self, value)  # type: ignore[attr-defined]

    @property
    def np_random_seed(self) -> int:
        """The seed of `np_random` (gymnasium's)."""
        if self._pending_seed is not None:
            return self._pending_seed
        return int(gymnasium.Env.np_random_seed.fget(self))  # type: ignore[attr-defined]

    @property
    def dataset(self) -> Sequence[Mapping[str, Any]]:
        if self._dataset is None:
            self._dataset = list(self.load_dataset())
        return self._dataset

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Observation, dict[str, Any]]:
        self._seed_lazily(seed)
        task = (options or {}).get("task")
        self.task = dict(task) if task is not None else self.sample_task(self.np_random)
        self.turn = 0
        self.done = False
        self.on_reset(self.task)
        observation = tuple(as_message(m, role="user") for m in self.initial_messages(self.task))
        self.history = list(observation)
        info = ResetInfo(task_id_of(self.task), tuple(self.tool_schemas()))
        return observation, info.to_info()

    def on_reset(self, task: Mapping[str, Any]) -> None:
        """Hook to reset per-episode state before `initial_messages` (optional)."""

    def step(self, action: Message | str) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        message = self._before_step(action)
        return self._after_step(self.on_action(message))

    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Observation, dict[str, Any]]:
        if self.step_in_thread:
            return await asyncio.to_thread(self.reset, seed=seed, options=options)
        return self.reset(seed=seed, options=options)

    async def astep(
        self, action: Message | str
    ) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        message = self._before_step(action)
        return self._after_step(await self.aon_action(message))

    def _before_step(self, action: Message | str) -> Message:
        if self.task is None:
            raise gymnasium.error.ResetNeeded("call reset() before step()")
        if self.done:
            raise gymnasium.error.ResetNeeded("the episode is over; call reset() first")
        message = self.message_from_text(action) if isinstance(action, str) else as_message(action)
        if message.role != "assistant":
            raise ValueError(f"an action must be an assistant message, got role {message.role!r}")
        self.turn += 1
        self.history.append(message)
        return message

    def _after_step(
        self, result: StepResult
    ) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        observation = tuple(as_message(m, role="user") for m in result.observation)
        self.history.extend(observation)
        terminated = bool(result.terminated)
        truncated = not terminated and self.turn >= self.max_turns
        self.done = terminated or truncated
        # env-specific keys may still name a typed field (older envs): from_info lifts them
        typed = StepInfo.from_info(result.info)
        stop = result.stop_reason or typed.stop_reason
        if stop is None and (terminated or truncated):
            stop = StopReason.TERMINATED if terminated else StopReason.TRUNCATED
        info = StepInfo(
            stop_reason=stop,
            tool_calls=_first(result.tool_calls, typed.tool_calls),
            tool_errors=_first(result.tool_errors, typed.tool_errors),
            sandbox_s=_first(result.sandbox_s, typed.sandbox_s),
            final_reward=_first(result.final_reward, typed.final_reward),
            extra=typed.extra,
        ).to_info()
        return observation, float(result.reward), terminated, truncated, info

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        return "\n".join(f"[{m.role}] {m.content}" for m in self.history)

    def close(self) -> None:
        self.closed = True  # idempotent; subclasses release resources and call super().close()

    # ----- snapshot / fork ----------------------------------------------------------------
    def snapshot(self) -> bytes:
        """The episode state as bytes (restore with `restore`); excludes shared resources."""
        state = {k: v for k, v in self.__dict__.items() if k not in self.snapshot_exclude}
        return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)

    def restore(self, state: bytes) -> None:
        """Return to a state taken by `snapshot` (of this env or of one of the same class)."""
        self.__dict__.update(pickle.loads(state))

    def fork(self) -> Env:
        """An independent copy at the current point of the episode (shared resources kept)."""
        clone = copy.copy(self)
        clone.__dict__ = dict(self.__dict__)
        clone.restore(self.snapshot())
        return clone


def _first(value: Any, fallback: Any) -> Any:
    return fallback if value is None else value


def _text_parser(name: str) -> Parser | None:
    return None if name.strip().lower() == "none" else get_parser(name)


class MultiTurnEnv(Env):
    """An env with per-turn rewards and a final reward added on the last turn.

    Implement `respond` (the env's reply and whether the episode is over) and optionally
    `turn_reward` and `final_reward`; the step reward is ``turn_reward`` plus, on the step that
    ends the episode (terminated or out of turns), ``final_reward``.
    """

    def __init__(self, *, max_turns: int = 8, **kwargs: Any) -> None:
        super().__init__(max_turns=max_turns, **kwargs)

    def respond(self, action: Message) -> StepResult:
        raise NotImplementedError(f"{type(self).__name__} must implement respond()")

    def turn_reward(self, action: Message, result: StepResult) -> float:
        return result.reward

    def final_reward(self) -> float:
        return 0.0

    def on_action(self, action: Message) -> StepResult:
        return self._with_rewards(action, self.respond(action))

    def _with_rewards(self, action: Message, result: StepResult) -> StepResult:
        reward = self.turn_reward(action, result)
        if result.terminated or self.turn >= self.max_turns:
            final = self.final_reward()
            if result.final_reward is None:
                result.final_reward = final
            reward += final
        result.reward = reward
        return result

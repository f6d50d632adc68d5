"""Text games: gymnasium's toy-text envs played in chat, and `wrap_gymnasium` for any discrete env.

Each turn the model sees the game as text and answers with a move inside ``<action>...</action>``
(the move's name, or its number); the move is played in the wrapped gymnasium env and the reply
shows the new state and the step's reward. Per-turn rewards are the gymnasium rewards.

Built in, in `palaestra.envs.toy_text` (data: none, boards come from the task's seed; licence:
gymnasium, MIT):

- ``palaestra/FrozenLake-v0``: a random 4x4 lake (not slippery), moves left/down/right/up;
  reward 1 on reaching the goal, the episode ends in a hole or at the goal.
- ``palaestra/Taxi-v0``: pick the passenger up and drop them at the destination; moves
  south/north/east/west/pickup/dropoff; -1 per step, +20 for the delivery, -10 for an illegal
  pickup/dropoff.
- ``palaestra/CliffWalking-v0``: walk from S to G along a cliff; moves up/right/down/left; -1 per
  step, -100 (and back to the start) for stepping into the cliff.
- ``palaestra/Blackjack-v0``: one hand against the dealer; moves stick/hit; reward +1 win,
  0 draw, -1 loss.

Task rows: ``{"seed": int}`` (FrozenLake also takes ``"size"``); without a task the seed is drawn
from the reset seed. ``info["success"]`` is 1.0 when the game was won (goal reached, passenger
delivered, hand won).

Invalid moves are never a way out: an unreadable or nonexistent move earns ``invalid_reward``,
by default the game's worst single-step reward (FrozenLake 0, Taxi -10, CliffWalking -100,
Blackjack -1), and ending the episode through ``max_invalid`` invalid moves in a row charges
every remaining turn the same, so giving up never scores better than playing badly.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import gymnasium
import numpy as np

from palaestra.envs.base import MultiTurnEnv, StepResult
from palaestra.envs.rewards import extract_tag
from palaestra.errors import ConfigError
from palaestra.types import Message, StopReason

RenderFn = Callable[[gymnasium.Env, Any], str]
ParseFn = Callable[[str], "int | None"]
SuccessFn = Callable[[gymnasium.Env, Any, float, bool], bool]

_MAX_DIGITS = 6  # a move number longer than this is no move (int() of 5,000 digits raises)


def _action_text(text: str) -> str:
    """The last ``<action>...</action>`` (any case), else the whole message."""
    found = extract_tag(text, "action", ignore_case=True)
    return text if found is None else found


def action_parser(names: Sequence[str]) -> ParseFn:
    """A parser reading the last ``<action>NAME</action>`` (a name of ``names`` or its index).

    A message that is only a bare name or number, without tags, is accepted too.
    """
    lookup = {name.lower(): i for i, name in enumerate(names)}

    def parse(text: str) -> int | None:
        candidate = _action_text(text).strip().strip(".").strip().lower()
        if candidate in lookup:
            return lookup[candidate]
        if re.fullmatch(rf"[0-9]{{1,{_MAX_DIGITS}}}", candidate):
            return int(candidate)
        return None

    return parse


def default_parse(text: str) -> int | None:
    """The integer inside the last ``<action>N</action>`` (or a bare integer message)."""
    candidate = _action_text(text).strip()
    return int(candidate) if re.fullmatch(rf"-?[0-9]{{1,{_MAX_DIGITS}}}", candidate) else None


def default_render(env: gymnasium.Env, observation: object) -> str:
    """The observation as text (and the env's ansi rendering when it has one)."""
    text = f"Observation: {observation}"
    if getattr(env, "render_mode", None) == "ansi":
        text = f"{env.render()}\n{text}"
    return text


class TextGameEnv(MultiTurnEnv):
    """A discrete-action gymnasium env played through text (see `wrap_gymnasium`)."""

    snapshot_exclude: ClassVar[tuple[str, ...]] = ("render_fn", "parse_fn", "success_fn")
    step_in_thread: ClassVar[bool] = False  # toy games step in microseconds
    #: ``invalid_reward`` when none is given: the game's worst single-step reward
    default_invalid_reward: ClassVar[float] = 0.0

    def __init__(
        self,
        env_id: str,
        *,
        render_fn: RenderFn = default_render,
        parse_fn: ParseFn = default_parse,
        instructions: str = "",
        env_kwargs: Mapping[str, Any] | None = None,
        success_fn: SuccessFn | None = None,
        max_turns: int = 30,
        invalid_reward: float | None = None,
        max_invalid: int = 3,
        **kwargs: Any,
    ) -> None:
        super().__init__(max_turns=max_turns, **kwargs)
        self.env_id = env_id
        self.env_kwargs = dict(env_kwargs or {})
        self.render_fn = render_fn
        self.parse_fn = parse_fn
        self.success_fn = success_fn
        self.instructions = instructions
        self.invalid_reward = float(self.default_invalid_reward if invalid_reward is None
                                    else invalid_reward)
        self.max_invalid = max_invalid
        self.game: gymnasium.Env | None = None
        self.game_obs: Any = None
        self.consecutive_invalid = 0
        self.total_reward = 0.0
        probe = self._make_game({})
        if not isinstance(probe.action_space, gymnasium.spaces.Discrete):
            raise ConfigError(
                f"{env_id} has action space {probe.action_space}; text games need a Discrete one"
            )
        probe.close()

    # ----- tasks ----------------------------------------------------------------------------
    def sample_task(self, rng: np.random.Generator) -> dict[str, Any]:
        if self._dataset is not None:
            return super().sample_task(rng)
        return {"seed": int(rng.integers(2**31 - 1))}

    def game_kwargs(self, task: Mapping[str, Any]) -> dict[str, Any]:
        """Keyword arguments of ``gymnasium.make`` for ``task`` (override for per-task boards)."""
        return dict(self.env_kwargs)

    def _make_game(self, task: Mapping[str, Any]) -> gymnasium.Env:
        try:
            return gymnasium.make(self.env_id, disable_env_checker=True, **self.game_kwargs(task))
        except gymnasium.error.Error as exc:
            raise ConfigError(f"cannot make the gymnasium env {self.env_id!r}: {exc}") from None

    def on_reset(self, task: Mapping[str, Any]) -> None:
        seed = task.get("seed")
        if seed is not None and not isinstance(seed, (int, np.integer)):
            raise ConfigError(f"a game task's 'seed' must be an integer, got {seed!r}")
        if self.game is not None:
            self.game.close()
        self.game = self._make_game(task)
        self.game_obs, _ = self.game.reset(seed=None if seed is None else int(seed))
        self.consecutive_invalid = 0
        self.total_reward = 0.0

    def initial_messages(self, task: Mapping[str, Any]) -> list[Message]:
        assert self.game is not None
        messages = [Message(role="user", content=self.render_fn(self.game, self.game_obs))]
        if self.instructions:
            messages.insert(0, Message(role="system", content=self.instructions))
        return messages

    # ----- steps ----------------------------------------------------------------------------
    def respond(self, action: Message) -> StepResult:
        assert self.game is not None
        move = self.parse_fn(action.content)
        n = int(self.game.action_space.n)  # type: ignore[attr-defined]
        if move is None or not 0 <= move < n:
            return self._invalid(move, n)
        self.consecutive_invalid = 0
        self.game_obs, reward, terminated, truncated, _ = self.game.step(move)
        reward = float(reward)
        self.total_reward += reward
        text = f"{self.render_fn(self.game, self.game_obs)}\nReward: {reward:g}"
        info: dict[str, Any] = {"move": move, "game_reward": reward}
        over = bool(terminated or truncated)
        if over or self.turn >= self.max_turns:
            success = self._success(reward, bool(terminated))
            info.update(success=float(success), total_reward=self.total_reward)
            text += "\nThe game is over." if over else ""
        return StepResult(
            observation=[Message(role="user", content=text)],
            reward=reward,
            terminated=over,
            info=info,
            stop_reason=StopReason.TRUNCATED if truncated and not terminated else None,
        )

    def _success(self, reward: float, terminated: bool) -> bool:
        assert self.game is not None
        if self.success_fn is not None:
            return bool(self.success_fn(self.game, self.game_obs, reward, terminated))
        return terminated and reward > 0

    def _invalid(self, move: int | None, n: int) -> StepResult:
        self.consecutive_invalid += 1
        what = "could not find a move" if move is None else f"move {move} does not exist"
        text = (
            f"Invalid action: {what}. Answer with <action>MOVE</action>, MOVE being one of the "
            f"moves listed (or its number, 0 to {n - 1}). Reward: {self.invalid_reward:g}."
        )
        info: dict[str, Any] = {"invalid_action": True}
        if self.consecutive_invalid >= self.max_invalid:
            # forfeit: this turn and every one left cost an invalid move, so stopping early by
            # answering nonsense never beats playing on (CliffWalking's best honest return is -13)
            forfeit = self.invalid_reward * (1 + max(0, self.max_turns - self.turn))
            self.total_reward += forfeit
            info.update(success=0.0, total_reward=self.total_reward, forfeit_reward=forfeit)
            return StepResult(
                observation=[Message(role="user", content=text)],
                reward=forfeit,
                terminated=True,
                info=info,
                stop_reason=StopReason.PARSE_ERROR,
            )
        self.total_reward += self.invalid_reward
        return StepResult(
            observation=[Message(role="user", content=text)], reward=self.invalid_reward, info=info
        )

    def close(self) -> None:
        if self.game is not None:
            self.game.close()
            self.game = None
        super().close()


def wrap_gymnasium(
    env_id: str,
    render_fn: RenderFn = default_render,
    parse_fn: ParseFn = default_parse,
    **kwargs: Any,
) -> TextGameEnv:
    """Make any discrete-action gymnasium env a palaestra text env.

    ``render_fn(env, observation) -> str`` shows the state (``env`` is the gymnasium env, so
    ``env.unwrapped`` is reachable); ``parse_fn(text) -> int | None`` reads the move from the
    assistant message (None = invalid). Other keyword arguments go to `TextGameEnv`
    (``instructions``, ``env_kwargs`` for ``gymnasium.make``, ``max_turns``, ``success_fn``...).
    """
    return TextGameEnv(env_id, render_fn=render_fn, parse_fn=parse_fn, **kwargs)

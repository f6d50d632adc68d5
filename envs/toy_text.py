"""The four toy-text games of gymnasium as chat envs (`TextGameEnv`s): FrozenLake, Taxi,
CliffWalking and Blackjack, each with its board rendered as text and its moves as words
(``palaestra/FrozenLake-v0`` and so on)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import gymnasium

from palaestra.envs.games import TextGameEnv, action_parser


# ----- the four toy-text games ------------------------------------------------------------------
def _instructions(game: str, moves: Sequence[str]) -> str:
    return (
        f"You are playing {game}. Each turn, think briefly, then give exactly one move as "
        f"<action>MOVE</action>, MOVE being one of: {', '.join(moves)}."
    )


FROZEN_LAKE_MOVES = ("left", "down", "right", "up")


def render_frozen_lake(env: gymnasium.Env, observation: Any) -> str:
    desc = env.unwrapped.desc  # type: ignore[attr-defined]
    ncol = desc.shape[1]
    row, col = divmod(int(observation), ncol)
    lines = []
    for r, cells in enumerate(desc):
        chars = [c.decode() for c in cells]
        if r == row:
            chars[col] = "P"
        lines.append(" ".join(chars))
    board = "\n".join(lines)
    return (
        f"{board}\nYou are P at row {row}, column {col} (rows and columns count from 0; row 0 is "
        "the top). S start, F frozen (safe), H hole (falling in ends the game), G goal.\n"
        f"Moves: {', '.join(FROZEN_LAKE_MOVES)}."
    )


class FrozenLakeTextEnv(TextGameEnv):
    """FrozenLake as text: reach G without falling into a hole; reward 1 at the goal.

    Task: ``{"seed": int, "size": 4}``, a random lake from gymnasium's ``generate_random_map``
    (not slippery by default). Tools: none; the move is ``<action>left|down|right|up</action>``.
    Reward per turn: gymnasium's (1 on reaching G, else 0); a hole ends the game. Data: none
    (boards come from the seed). Licence: gymnasium (MIT).
    """

    def __init__(self, *, size: int = 4, is_slippery: bool = False, max_turns: int = 20,
                 **kwargs: Any) -> None:
        self.size = size
        self.is_slippery = is_slippery
        super().__init__(
            "FrozenLake-v1",
            render_fn=render_frozen_lake,
            parse_fn=action_parser(FROZEN_LAKE_MOVES),
            instructions=_instructions("FrozenLake on a grid", FROZEN_LAKE_MOVES),
            max_turns=max_turns,
            **kwargs,
        )

    def game_kwargs(self, task: Mapping[str, Any]) -> dict[str, Any]:
        from gymnasium.envs.toy_text.frozen_lake import generate_random_map

        size = int(task.get("size", self.size))
        seed = task.get("seed")
        desc = generate_random_map(size=size, seed=None if seed is None else int(seed))
        return {"desc": desc, "is_slippery": self.is_slippery, **self.env_kwargs}


TAXI_MOVES = ("south", "north", "east", "west", "pickup", "dropoff")


_TAXI_PLACES = ("R", "G", "Y", "B")


def render_taxi(env: gymnasium.Env, observation: Any) -> str:
    game = env.unwrapped
    taxi_row, taxi_col, passenger, destination = game.decode(int(observation))  # type: ignore[attr-defined]
    lines = [row.copy() for row in game.desc]  # type: ignore[attr-defined]
    lines[1 + taxi_row][2 * taxi_col + 1] = b"T"
    board = "\n".join(b"".join(row).decode() for row in lines)
    where = "in the taxi" if passenger == 4 else f"waiting at {_TAXI_PLACES[passenger]}"
    return (
        f"{board}\nT is your taxi at row {taxi_row}, column {taxi_col} (from 0, row 0 at the top; "
        "'|' is a wall, ':' can be crossed). R, G, Y, B are the stops. The passenger is "
        f"{where}; the destination is {_TAXI_PLACES[destination]}.\nMoves: {', '.join(TAXI_MOVES)}."
    )


class TaxiTextEnv(TextGameEnv):
    """Taxi as text: pick the passenger up and drop them off; -1 per step, +20 on delivery.

    Task: ``{"seed": int}`` (taxi, passenger and destination from gymnasium's ``Taxi-v4`` reset).
    Tools: none; the move is ``<action>south|north|east|west|pickup|dropoff</action>``. Reward
    per turn: gymnasium's (-1 a step, +20 for the delivery, -10 for an illegal pickup/dropoff),
    -10 for an invalid move; ``info["success"]`` is 1 on delivery. Data: none. Licence: gymnasium (MIT).
    """

    default_invalid_reward: ClassVar[float] = -10.0  # an illegal pickup/dropoff

    def __init__(self, *, max_turns: int = 30, **kwargs: Any) -> None:
        super().__init__(
            "Taxi-v4",
            render_fn=render_taxi,
            parse_fn=action_parser(TAXI_MOVES),
            instructions=_instructions("Taxi on a 5x5 grid", TAXI_MOVES),
            max_turns=max_turns,
            **kwargs,
        )


CLIFF_MOVES = ("up", "right", "down", "left")


def render_cliff_walking(env: gymnasium.Env, observation: Any) -> str:
    nrow, ncol = env.unwrapped.shape  # type: ignore[attr-defined]
    row, col = divmod(int(observation), ncol)
    lines = []
    for r in range(nrow):
        cells = []
        for c in range(ncol):
            if (r, c) == (row, col):
                cells.append("P")
            elif r == nrow - 1 and c == 0:
                cells.append("S")
            elif r == nrow - 1 and c == ncol - 1:
                cells.append("G")
            elif r == nrow - 1:
                cells.append("C")
            else:
                cells.append(".")
        lines.append(" ".join(cells))
    board = "\n".join(lines)
    return (
        f"{board}\nYou are P at row {row}, column {col} (from 0, row 0 at the top). Walk from S to "
        "G; C is the cliff (stepping in costs -100 and sends you back to S), '.' is safe ground. "
        f"Each step costs -1.\nMoves: {', '.join(CLIFF_MOVES)}."
    )


def _reached_goal(env: gymnasium.Env, observation: Any, reward: float, terminated: bool) -> bool:
    return terminated  # CliffWalking ends only at the goal


class CliffWalkingTextEnv(TextGameEnv):
    """CliffWalking as text: reach G along the cliff edge; -1 per step, -100 for the cliff.

    Task: ``{"seed": int}`` (the 4x12 board is fixed). Tools: none; the move is
    ``<action>up|right|down|left</action>``. Reward per turn: gymnasium's (-1 a step, -100 and
    back to S for the cliff), -100 for an invalid move; ``info["success"]`` is 1 at G. Data: none. Licence: gymnasium (MIT).
    """

    default_invalid_reward: ClassVar[float] = -100.0  # the cliff

    def __init__(self, *, max_turns: int = 30, **kwargs: Any) -> None:
        super().__init__(
            "CliffWalking-v1",
            render_fn=render_cliff_walking,
            parse_fn=action_parser(CLIFF_MOVES),
            instructions=_instructions("CliffWalking on a 4x12 grid", CLIFF_MOVES),
            success_fn=_reached_goal,
            max_turns=max_turns,
            **kwargs,
        )


BLACKJACK_MOVES = ("stick", "hit")


def render_blackjack(env: gymnasium.Env, observation: Any) -> str:
    game = env.unwrapped
    player_sum, dealer_card, usable_ace = observation
    cards = ", ".join(str(c) for c in game.player)  # type: ignore[attr-defined]
    return (
        f"Your cards: {cards} (total {player_sum}"
        f"{', with an ace counted as 11' if usable_ace else ''}). The dealer shows {dealer_card} "
        "(1 is an ace). Get closer to 21 than the dealer without going over.\n"
        f"Moves: {', '.join(BLACKJACK_MOVES)}."
    )


class BlackjackTextEnv(TextGameEnv):
    """Blackjack as text: one hand against the dealer; +1 win, 0 draw, -1 loss.

    Task: ``{"seed": int}`` (the deal comes from the seed; Sutton & Barto rules). Tools: none; the
    move is ``<action>stick|hit</action>``. Reward: gymnasium's, at the end of the hand (-1 for
    an invalid move);
    ``info["success"]`` is 1 for a win. Data: none. Licence: gymnasium (MIT).
    """

    default_invalid_reward: ClassVar[float] = -1.0  # a lost hand

    def __init__(self, *, max_turns: int = 8, **kwargs: Any) -> None:
        super().__init__(
            "Blackjack-v1",
            render_fn=render_blackjack,
            parse_fn=action_parser(BLACKJACK_MOVES),
            instructions=_instructions("Blackjack", BLACKJACK_MOVES),
            max_turns=max_turns,
            **kwargs,
        )


__all__ = [
    "BLACKJACK_MOVES",
    "BlackjackTextEnv",
    "CLIFF_MOVES",
    "CliffWalkingTextEnv",
    "FROZEN_LAKE_MOVES",
    "FrozenLakeTextEnv",
    "TAXI_MOVES",
    "TaxiTextEnv",
    "render_blackjack",
    "render_cliff_walking",
    "render_frozen_lake",
    "render_taxi",
]

"""Gymnasium spaces over chat messages, accepted by ``gymnasium.utils.env_checker.check_env``.

An observation is a tuple of new `Message`s; an action is one assistant `Message` (or a plain
string, which the env parses into one with its tool-call format). ``sample()`` draws short random texts so the checker can step an env.
"""

from __future__ import annotations

import gymnasium
import numpy as np

from palaestra.types import Message

_WORDS = ("the", "answer", "is", "42", "<answer>", "</answer>", "search", "1 + 2", "ok")


class MessagesSpace(gymnasium.spaces.Space[tuple[Message, ...]]):
    """A tuple of chat messages (the new messages an env step produced)."""

    def __init__(self, roles: tuple[str, ...] = ("system", "user", "tool"), seed: int | None = None):
        super().__init__(shape=None, dtype=None, seed=seed)
        self.roles = roles

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def sample(self, mask: object | None = None, probability: object | None = None) -> tuple[Message, ...]:
        n = int(self.np_random.integers(1, 3))
        return tuple(
            Message(role=str(self.np_random.choice(self.roles)), content=_random_text(self.np_random))
            for _ in range(n)
        )

    def contains(self, x: object) -> bool:
        return isinstance(x, tuple) and all(
            isinstance(m, Message) and m.role in self.roles for m in x
        )

    def __repr__(self) -> str:
        return f"MessagesSpace(roles={self.roles})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MessagesSpace) and other.roles == self.roles


class AssistantMessageSpace(gymnasium.spaces.Space[Message]):
    """One assistant message; plain strings are members too (they are parsed on ``step``)."""

    def __init__(self, seed: int | None = None):
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def sample(self, mask: object | None = None, probability: object | None = None) -> Message:
        return Message(role="assistant", content=_random_text(self.np_random))

    def contains(self, x: object) -> bool:
        if isinstance(x, str):
            return True
        return isinstance(x, Message) and x.role == "assistant"

    def __repr__(self) -> str:
        return "AssistantMessageSpace()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AssistantMessageSpace)


def _random_text(rng: np.random.Generator) -> str:
    n = int(rng.integers(1, 8))
    return " ".join(str(rng.choice(_WORDS)) for _ in range(n))

"""``palaestra/HiddenRule-v0``: pick a number in a stated range, where only some picks are right.

Task: "Give a number from 340 to 349." (a decade of three-digit numbers, drawn from the reset
seed, or a row ``{"question", "low", "high"}``). The answer is ``<answer>N</answer>``. Reward:
1.0 when N is in the range *and* obeys a rule the prompt never states (``rule="even"`` by default:
N is even; ``"odd"``: N is odd), else 0.0. The task exists for learning a hidden rule from
preferences alone (configs/rm_train.toml, configs/rl_with_rm.toml): a policy warm-started on
`demonstrations` (uniform picks in the range) succeeds about half the time, and a reward model
trained on preference pairs that follow the rule (scripts/make_rm_example_data.py) is the only
place the rule can be learnt from. Data: generated, no licence needed. No tools.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from palaestra.envs.tool_env import ToolEnv
from palaestra.errors import ConfigError
from palaestra.types import Message

SYSTEM_PROMPT = "Answer with one number as <answer>N</answer>."
RULES = ("even", "odd")
_ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


def follows_rule(value: int, rule: str) -> bool:
    """Whether ``value`` obeys the hidden ``rule`` (one of `RULES`)."""
    return value % 2 == (0 if rule == "even" else 1)


def parse_answer(text: str | None) -> int | None:
    """The integer in the first ``<answer>N</answer>`` of ``text`` (None: no such tag)."""
    match = _ANSWER.search(text or "")
    return int(match.group(1)) if match else None


def make_task(rng: np.random.Generator, min_decade: int = 10, max_decade: int = 99) -> dict[str, Any]:
    """One task: the decade ``10*d .. 10*d + 9`` for a random ``d`` in [min_decade, max_decade]."""
    low = 10 * int(rng.integers(min_decade, max_decade + 1))
    high = low + 9
    return {"id": f"pick-{low}-{high}", "question": f"Give a number from {low} to {high}.",
            "low": low, "high": high}


class HiddenRuleEnv(ToolEnv):
    """One-turn number picking; reward 1 for an in-range pick that obeys the hidden rule."""

    task_fields: ClassVar[tuple[str | tuple[str, ...], ...]] = ("question", "low", "high")

    def __init__(
        self,
        *,
        rule: str = "even",
        min_decade: int = 10,
        max_decade: int = 99,
        system_prompt: str = SYSTEM_PROMPT,
        max_turns: int = 1,
        **kwargs: Any,
    ) -> None:
        if rule not in RULES:
            raise ConfigError(f"HiddenRule-v0: rule must be one of {RULES}, got {rule!r}")
        if not 1 <= min_decade <= max_decade:
            raise ConfigError(
                f"HiddenRule-v0: need 1 <= min_decade <= max_decade, got {min_decade}, {max_decade}"
            )
        super().__init__(max_turns=max_turns, **kwargs)
        self.rule = rule
        self.min_decade = min_decade
        self.max_decade = max_decade
        self.system_prompt = system_prompt

    def sample_task(self, rng: np.random.Generator) -> dict[str, Any]:
        if self._dataset is not None:
            return super().sample_task(rng)
        return make_task(rng, self.min_decade, self.max_decade)

    def initial_messages(self, task: Mapping[str, Any]) -> list[Message]:
        return [Message(role="system", content=self.system_prompt),
                Message(role="user", content=str(task["question"]))]

    def _verdict(self, action: Message) -> tuple[int | None, bool, bool]:
        assert self.task is not None
        value = parse_answer(action.content)
        in_range = value is not None and int(self.task["low"]) <= value <= int(self.task["high"])
        return value, in_range, in_range and follows_rule(value, self.rule)  # type: ignore[arg-type]

    def score(self, action: Message) -> float:
        return 1.0 if self._verdict(action)[2] else 0.0

    def answer_info(self, action: Message) -> dict[str, Any]:
        value, in_range, correct = self._verdict(action)
        return {"answer": value, "in_range": in_range, "correct": correct}


def demonstrations(
    n: int,
    *,
    seed: int = 0,
    env_kwargs: Mapping[str, Any] | None = None,
) -> list[list[dict[str, Any]]]:
    """Warm-start transcripts that know the format and the range but not the rule.

    Each answers a uniformly random number of the stated range, so about half obey the rule: SFT
    on them teaches the task's surface, and only a reward for the rule can teach the rest.
    """
    rng = np.random.default_rng(seed)
    env = HiddenRuleEnv(**dict(env_kwargs or {}))
    dialogues = []
    for _ in range(n):
        task = env.sample_task(rng)
        system, user = env.initial_messages(task)
        pick = int(rng.integers(task["low"], task["high"] + 1))
        dialogues.append([system.to_dict(), user.to_dict(),
                          {"role": "assistant", "content": f"<answer>{pick}</answer>"}])
    return dialogues

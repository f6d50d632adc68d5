"""Math word problems: ``palaestra/GSM8K-v0`` and ``palaestra/MATH-v0``, with an optional python tool.

Both envs grade the final assistant message (one without tool calls): the answer is read from the
last ``\\boxed{...}`` (nested braces allowed), else from ``#### N``, else from the last
``<answer>...</answer>``, and compared with the gold answer numerically (thousands separators,
currency, units, fractions and decimals of the same value count as equal) and otherwise
symbolically with ``math-verify`` (LaTeX, sympy), under a time limit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from palaestra.envs.base import StepResult
from palaestra.envs.python_tool import SandboxChoice, python_tool
from palaestra.envs.rewards import (
    extract_boxed,
    extract_hash_answer,
    extract_tag,
    math_equal,
    numbers_equal,
    numeric_value,
)
from palaestra.envs.shipped import load_rows
from palaestra.envs.tool_env import ToolEnv
from palaestra.errors import ConfigError
from palaestra.types import Message

SYSTEM_PROMPT = (
    "Solve the math problem step by step. Write the final answer, and nothing else, inside "
    "\\boxed{}."
)
TOOL_PROMPT = (
    " You can run Python with the python tool to compute or check intermediate results; it "
    "shows what your program prints."
)


def extract_final_answer(text: str) -> str | None:
    """The model's final answer: last ``\\boxed{}``, else ``#### N``, else last ``<answer>``."""
    for extract in (extract_boxed, extract_hash_answer, extract_tag):
        found = extract(text)
        if found is not None:
            return found
    return None


def gsm8k_gold(task: Mapping[str, Any]) -> str:
    """The number after ``####`` in a GSM8K ``answer`` (a bare number is accepted too)."""
    answer = task.get("answer")
    if answer is None:
        raise ConfigError(f"a GSM8K task needs 'question' and 'answer'; got keys {sorted(task)}")
    text = str(answer)
    gold = extract_hash_answer(text) if "####" in text else text.strip()
    if not gold:
        raise ConfigError(f"the GSM8K answer has nothing after '####': {text[-80:]!r}")
    return gold.replace(",", "")


def gsm8k_correct(prediction: str | None, gold: str) -> bool:
    """GSM8K grading: numbers compare by value (units, $ and commas ignored), else symbolically."""
    if prediction is None:
        return False
    pred_value, gold_value = numeric_value(prediction), numeric_value(gold)
    if pred_value is not None and gold_value is not None:
        return numbers_equal(pred_value, gold_value)
    return math_equal(prediction, gold)


def math_gold(task: Mapping[str, Any]) -> str:
    """The gold answer of a MATH row: ``answer``, else the last box of ``solution``."""
    if task.get("answer") is not None:
        return str(task["answer"])
    boxed = extract_boxed(str(task.get("solution", "")))
    if boxed is None:
        raise ConfigError(
            f"a MATH task needs 'problem' and 'answer' (or a 'solution' with \\boxed{{}}); "
            f"got keys {sorted(task)}"
        )
    return boxed


class _MathEnv(ToolEnv):
    """Shared mechanics: dataset by name or path, optional python tool, graded final answer."""

    snapshot_exclude: ClassVar[tuple[str, ...]] = ("_tools", "_dataset", "sandbox")
    DATASETS: ClassVar[dict[str, str]] = {}
    question_key: ClassVar[str] = "question"
    task_fields: ClassVar[tuple[str | tuple[str, ...], ...]] = ("question", "answer")

    def __init__(
        self,
        *,
        dataset: str | Path | Sequence[Mapping[str, Any]] = "test",
        python_tool: bool = False,
        sandbox: SandboxChoice = None,
        code_timeout_s: float = 10.0,
        max_turns: int | None = None,
        system_prompt: str | None = None,
        **kwargs: Any,
    ) -> None:
        rows = None if isinstance(dataset, (str, Path)) else dataset
        self.sandbox = sandbox
        tools = [_python_tool_for(self, code_timeout_s)] if python_tool else []
        turns = max_turns if max_turns is not None else (6 if python_tool else 1)
        super().__init__(tools=tools, max_turns=turns, dataset=rows, **kwargs)
        self.dataset_source: str | Path = dataset if isinstance(dataset, (str, Path)) else "(rows)"
        self.python_tool = python_tool
        prompt = system_prompt if system_prompt is not None else SYSTEM_PROMPT
        self.system_prompt = prompt + (TOOL_PROMPT if python_tool and system_prompt is None else "")

    def load_dataset(self) -> Sequence[Mapping[str, Any]]:
        return load_rows(self.dataset_source, self.DATASETS)

    def gold(self, task: Mapping[str, Any]) -> str:
        raise NotImplementedError

    def is_correct(self, prediction: str | None, gold: str) -> bool:
        raise NotImplementedError

    def on_reset(self, task: Mapping[str, Any]) -> None:
        super().on_reset(task)
        if not isinstance(task.get(self.question_key), str):
            raise ConfigError(f"the task needs a {self.question_key!r} string; got keys {sorted(task)}")
        self.gold(task)  # a bad row fails at reset, not at the end of the episode

    def initial_messages(self, task: Mapping[str, Any]) -> list[Message]:
        return [
            Message(role="system", content=self.system_prompt),
            Message(role="user", content=str(task[self.question_key])),
        ]

    def grade(self, text: str) -> dict[str, Any]:
        """``{"answer", "gold", "correct"}`` for a final message's text."""
        assert self.task is not None
        gold = self.gold(self.task)
        answer = extract_final_answer(text)
        return {"answer": answer, "gold": gold, "correct": self.is_correct(answer, gold)}

    def score(self, action: Message) -> float:
        return 1.0 if self.grade(action.content)["correct"] else 0.0

    def _graded(self, metrics: dict[str, Any]) -> StepResult:
        return StepResult(reward=1.0 if metrics["correct"] else 0.0, terminated=True, info=metrics)

    def on_action(self, action: Message) -> StepResult:
        if action.tool_calls and self.tools:  # without tools, any message is the answer
            return super().on_action(action)
        # a blocking caller grades in its own thread (the main thread can use signal timeouts)
        return self._with_rewards(action, self._graded(self.grade(action.content)))

    async def arespond(self, action: Message) -> StepResult:
        if action.tool_calls and self.tools:
            return await super().arespond(action)
        # symbolic checks can take seconds: keep them off the event loop
        return self._graded(await asyncio.to_thread(self.grade, action.content))


def _python_tool_for(env: _MathEnv, timeout_s: float) -> Any:
    return python_tool(env, timeout_s=timeout_s)


class GSM8KEnv(_MathEnv):
    """GSM8K grade-school math: final answer in \\boxed{} or after ####, graded by value.

    Task: ``{"question", "answer": "<worked solution> #### 72"}`` (upstream GSM8K rows); the gold
    is the number after ``####``.
    Tools: none by default; ``python_tool=True`` adds ``python(code)``, run in the sandbox
    (`palaestra.sandbox`), and allows ``max_turns`` (default 6) turns.
    Reward: 1.0 when the final answer (last ``\\boxed{}``, else ``#### N``, else ``<answer>``)
    equals the gold number: ``$1,000.00``, ``1000 dollars`` and ``\\frac{2000}{2}`` all equal
    ``1000``; else 0. Info: ``answer``, ``gold``, ``correct``.
    Data: ``dataset="test"`` (1,319 rows, default) or ``"train"`` (7,473) from
    openai/grade-school-math (MIT), or a JSONL path.
    """

    DATASETS: ClassVar[dict[str, str]] = {
        "test": "math/gsm8k_test.jsonl.gz",
        "train": "math/gsm8k_train.jsonl.gz",
    }

    def gold(self, task: Mapping[str, Any]) -> str:
        return gsm8k_gold(task)

    def is_correct(self, prediction: str | None, gold: str) -> bool:
        return gsm8k_correct(prediction, gold)


class MATHEnv(_MathEnv):
    """Competition math (MATH-500): final answer in \\boxed{}, graded with math-verify.

    Task: ``{"problem", "answer"}`` (MATH rows; the answer may be LaTeX such as
    ``\\left( 3, \\frac{\\pi}{2} \\right)``; without ``answer`` the last box of ``solution``).
    Tools: none by default; ``python_tool=True`` adds ``python(code)`` run in the sandbox.
    Reward: 1.0 when the last ``\\boxed{}`` of the final message is equivalent to the gold answer
    (equal numbers, or ``math-verify`` finds them equal: ``\\frac12`` = ``0.5``, ``(3, \\pi/2)``,
    ``\\sqrt{18}`` = ``3\\sqrt{2}``, sets in any order, ``\\text{(C)}`` = ``C``), else 0.
    Info: ``answer``, ``gold``, ``correct``.
    Data: ``dataset="test"``: MATH-500, the 500-problem test subset of PRM800K (MIT; MATH by
    Hendrycks et al., MIT), or a JSONL path.
    """

    DATASETS: ClassVar[dict[str, str]] = {"test": "math/math500_test.jsonl.gz"}
    question_key: ClassVar[str] = "problem"
    task_fields: ClassVar[tuple[str | tuple[str, ...], ...]] = ("problem", ("answer", "solution"))

    def gold(self, task: Mapping[str, Any]) -> str:
        return math_gold(task)

    def is_correct(self, prediction: str | None, gold: str) -> bool:
        return math_equal(prediction, gold)

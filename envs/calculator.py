"""``palaestra/Calculator-v0``: arithmetic questions answered with the help of a calculator tool.

Task: a question such as "What is 347 * 29 + 18?" generated from the reset seed (or given as a
row ``{"question", "answer", "expression"}``). Tool: ``calculator(expression)`` evaluates
+ - * / // % ** and parentheses exactly (no ``eval``). Reward: 1.0 when the final assistant message
(one without tool calls) contains ``<answer>N</answer>`` equal to the true value, else 0.0.
Data: generated, no licence needed. This is also the quickstart task.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from palaestra.envs.tool_env import ToolEnv
from palaestra.envs.tools import tool
from palaestra.errors import ToolError
from palaestra.types import Message

SYSTEM_PROMPT = (
    "You are a careful assistant. Use the calculator tool to compute arithmetic, then give the "
    "final result as <answer>NUMBER</answer>."
)
_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def evaluate_arithmetic(expression: str) -> int | float:
    """Evaluate an arithmetic expression safely; raises `ToolError` for anything else."""
    if len(expression) > 200:
        raise ToolError("the expression is too long (over 200 characters)")
    try:
        tree = ast.parse(expression.replace("^", "**"), mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expression!r} as arithmetic") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    value = node.value if isinstance(node, ast.Constant) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):  # ast makes no subclasses
        return value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise ToolError("exponent too large")
        try:
            return _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
    raise ToolError(f"unsupported syntax {type(node).__name__}; use numbers and + - * / ( )")


def _format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6)) if isinstance(value, float) else str(value)


def extract_answer(text: str) -> str | None:
    """The content of the last ``<answer>...</answer>`` block, or None."""
    found = _ANSWER.findall(text)
    return found[-1] if found else None


class CalculatorEnv(ToolEnv):
    """Arithmetic questions generated from the seed; a calculator tool; reward 1 for the answer."""

    task_fields: ClassVar[tuple[str | tuple[str, ...], ...]] = ("question", "answer")

    def __init__(
        self,
        *,
        min_value: int = 10,
        max_value: int = 999,
        num_operations: int = 2,
        operators: Sequence[str] = ("+", "-", "*"),
        max_turns: int = 4,
        system_prompt: str = SYSTEM_PROMPT,
        **kwargs: Any,
    ) -> None:
        super().__init__(max_turns=max_turns, **kwargs)
        self.min_value = min_value
        self.max_value = max_value
        self.num_operations = num_operations
        self.operators = tuple(operators)
        self.system_prompt = system_prompt

    def sample_task(self, rng: np.random.Generator) -> dict[str, Any]:
        if self._dataset is not None:
            return super().sample_task(rng)
        return make_task(rng, self.min_value, self.max_value, self.num_operations, self.operators)

    def initial_messages(self, task: Mapping[str, Any]) -> list[Message]:
        return [
            Message(role="system", content=self.system_prompt),
            Message(role="user", content=str(task["question"])),
        ]

    @tool(blocking=False)
    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expression: numbers combined with + - * / // % ** and parentheses, e.g. "12 * (3 + 4)".
        """
        return _format_number(evaluate_arithmetic(expression))

    def score(self, action: Message) -> float:
        assert self.task is not None
        return 1.0 if answers_match(extract_answer(action.content), str(self.task["answer"])) else 0.0

    def answer_info(self, action: Message) -> dict[str, Any]:
        assert self.task is not None
        given = extract_answer(action.content)
        gold = str(self.task["answer"])
        return {"answer": given, "gold": gold, "correct": answers_match(given, gold)}


def answers_match(given: str | None, gold: str) -> bool:
    if given is None:
        return False
    given = given.replace(",", "").strip()
    try:
        return abs(float(given) - float(gold)) < 1e-6
    except ValueError:
        return given == gold.strip()


def make_task(
    rng: np.random.Generator,
    min_value: int,
    max_value: int,
    num_operations: int,
    operators: Sequence[str],
) -> dict[str, Any]:
    """One random arithmetic question (deterministic for a given generator state)."""
    numbers = [int(rng.integers(min_value, max_value + 1)) for _ in range(num_operations + 1)]
    ops = [str(rng.choice(list(operators))) for _ in range(num_operations)]
    expression = str(numbers[0])
    for op, number in zip(ops, numbers[1:]):
        expression += f" {op} {number}"
    answer = _format_number(evaluate_arithmetic(expression))
    return {
        "id": f"calc-{expression.replace(' ', '')}",
        "question": f"What is {expression}?",
        "expression": expression,
        "answer": answer,
    }


def demonstrations(
    n: int,
    *,
    seed: int = 0,
    tool_fraction: float = 0.4,
    env_kwargs: Mapping[str, Any] | None = None,
) -> list[list[dict[str, Any]]]:
    """Imperfect chat demonstrations for an SFT warm start (OpenAI message dicts).

    A ``tool_fraction`` of them call the calculator and copy its result into the answer (right);
    the others answer at once with a random guess of the same length (almost always wrong). SFT on
    this mix teaches the format and both behaviours; RL must then learn which one earns reward.
    """
    rng = np.random.default_rng(seed)
    env = CalculatorEnv(**dict(env_kwargs or {}))
    dialogues = []
    for i in range(n):
        task = env.sample_task(rng)
        system, user = env.initial_messages(task)
        messages = [system.to_dict(), user.to_dict()]
        if rng.random() < tool_fraction:
            call = {
                "id": f"call_{i}",
                "type": "function",
                "function": {
                    "name": "calculator",
                    "arguments": json.dumps({"expression": task["expression"]}),
                },
            }
            messages += [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": task["answer"], "tool_call_id": call["id"], "name": "calculator"},
                {"role": "assistant", "content": f"<answer>{task['answer']}</answer>"},
            ]
        else:
            # a guess with as many digits as the true value, almost never right
            digits = len(task["answer"].lstrip("-"))
            guess = int(rng.integers(10 ** (digits - 1) if digits > 1 else 0, 10**digits))
            if str(guess) == task["answer"]:
                guess += 1
            messages.append({"role": "assistant", "content": f"<answer>{guess}</answer>"})
        dialogues.append(messages)
    return dialogues

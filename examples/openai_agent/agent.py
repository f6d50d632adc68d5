"""A shopping agent written with the plain ``openai`` client and two tools: ``lookup`` (a price
list) and ``calculator``. Nothing in it knows about palaestra: it is trained and evaluated through
`palaestra.envs.external_agent.ExternalAgentEnv` and the agent gateway, which give it an ``OPENAI_BASE_URL``.

Question: "How much do 7 pears cost?"  The agent loops: ask the model (with the two tools), run
the tool calls it makes, send the results back, until the model answers without a call.
Reward: 1.0 when the answer's ``<answer>N</answer>`` is the right total, else 0.0.

    # as a command (what ExternalAgentEnv(command=["python", "agent.py"]) runs in the sandbox):
    OPENAI_BASE_URL=http://127.0.0.1:8900/sessions/s1/v1 OPENAI_API_KEY=x \\
        PALAESTRA_TASK='{"question": "How much do 7 pears cost?", "answer": "35"}' \\
        python examples/openai_agent/agent.py

Training (GRPO, CPU, tiny model) is ``examples/openai_agent/train.py``; evaluation registers the
benchmark in ``shop_bench.py`` (see README.md next to this file).
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import os
import random
import re
from typing import Any

from openai import AsyncOpenAI

PRICES = {"apple": 3, "pear": 5, "lemon": 2, "melon": 7, "grape": 4, "peach": 6, "plum": 9,
          "kiwi": 8}
SYSTEM_PROMPT = (
    "Tools: lookup(item) gives the unit price of a fruit, calculator(expression) computes. "
    'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>; '
    "answer <answer>N</answer>."
)
TOOLS = [
    {"type": "function", "function": {
        "name": "lookup", "description": "unit price of a fruit",
        "parameters": {"type": "object", "properties": {"item": {"type": "string"}},
                       "required": ["item"]}}},
    {"type": "function", "function": {
        "name": "calculator", "description": "evaluate arithmetic",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
]
_ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def make_task(seed: int) -> dict[str, Any]:
    """A question with its answer, drawn from ``seed``."""
    rng = random.Random(seed)
    item = rng.choice(sorted(PRICES))
    quantity = rng.randint(2, 9)
    return {"id": f"shop-{seed}", "question": f"How much do {quantity} {item}s cost?",
            "item": item, "quantity": quantity, "answer": str(quantity * PRICES[item])}


def initial_messages(task: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": task["question"]}]


def _calc(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_calc(node.left), _calc(node.right))
    raise ValueError("use integers and + - *")


def run_tool(name: str, arguments: str) -> str:
    """Execute one tool call; mistakes come back as error text the model can read."""
    try:
        args = json.loads(arguments)
        if name == "lookup":
            item = str(args["item"]).strip().lower().rstrip("s")
            return str(PRICES[item]) if item in PRICES else f"error: no price for {item!r}"
        if name == "calculator":
            return str(_calc(ast.parse(str(args["expression"]), mode="eval").body))
        return f"error: unknown tool {name!r}"
    except (ValueError, KeyError, TypeError, SyntaxError, RecursionError) as exc:
        return f"error: {exc}"


async def solve(base_url: str, task: dict[str, Any], *, max_turns: int = 4) -> str:
    """The agent: the model's final message (or "" when it never stops calling tools)."""
    client = AsyncOpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "none"),
                         max_retries=0)
    messages = initial_messages(task)
    for _ in range(max_turns):
        response = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=48)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


def reward(task: dict[str, Any], outcome: Any, messages: Any) -> float:
    """1.0 for the right total in ``<answer>N</answer>``, else 0.0."""
    found = _ANSWER.findall(outcome or "") if isinstance(outcome, str) else []
    return 1.0 if found and found[-1] == str(task["answer"]) else 0.0


if __name__ == "__main__":
    the_task = json.loads(os.environ["PALAESTRA_TASK"])
    print(json.dumps(asyncio.run(solve(os.environ["OPENAI_BASE_URL"], the_task))))

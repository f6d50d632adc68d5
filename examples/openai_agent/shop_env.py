"""The shopping agent (agent.py) as a palaestra env, a benchmark and a source of demonstrations.

Importing this module (``--import shop_env`` for ``palaestra eval``; the env id
``shop_env:examples/OpenAIShopAgent-v0`` makes ``palaestra train`` and the rollout workers import
it) registers

- the env ``examples/OpenAIShopAgent-v0``: `ExternalAgentEnv` around ``agent.solve`` (the plain ``openai``
  client loop), scored by ``agent.reward``, tasks from ``agent.make_task``;
- the benchmark ``openai-agent-shop``: 200 questions drawn from seeds the training data never uses;
- ``demonstrations(n, seed=..., env_kwargs=..., p_wrong=...)``: transcripts of the ideal tool use
  for the SFT warm start of train.toml, a ``p_wrong`` share with a wrong final number.

Put this folder on the path: ``PYTHONPATH=examples/openai_agent``.
"""

from __future__ import annotations

import json
import random
from typing import Any

import agent as shop

from palaestra.benchmarks import Benchmark, register_benchmark
from palaestra.envs import register

ENV_ID = "examples/OpenAIShopAgent-v0"
EVAL_SEED = 10**7  # benchmark questions come from seeds >= this; training draws stay below 2**31

register(ENV_ID, "palaestra.envs.external_agent:ExternalAgentEnv", agent="agent:solve",
         reward_fn="agent:reward", task_fn="agent:make_task", tools=shop.TOOLS, max_calls=4,
         timeout_s=300)

register_benchmark(Benchmark(
    name="openai-agent-shop",
    env_id=f"shop_env:{ENV_ID}",
    dataset=lambda: [shop.make_task(EVAL_SEED + i) for i in range(200)],  # small space: repeats
    agent={"tools_in_prompt": False, "max_context": 512},  # as in train.toml
    answer=None,
    max_new_tokens=48,
    description="shopping questions answered by the openai-client agent with lookup + calculator",
))


def demonstrations(n: int, *, seed: int = 0, env_kwargs: Any = None,
                   p_wrong: float = 0.5) -> list[list[dict[str, Any]]]:
    """``n`` transcripts of the agent's conversation: lookup, calculator, answer."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        task = shop.make_task(rng.randrange(EVAL_SEED))
        price = shop.PRICES[task["item"]]
        answer = int(task["answer"])
        if rng.random() < p_wrong:  # imperfect on purpose: RL has to learn to copy the total
            answer = rng.choice([a for a in range(4, 100) if a != answer])
        messages = shop.initial_messages(task)
        steps = [("lookup", {"item": task["item"]}, str(price)),
                 ("calculator", {"expression": f"{task['quantity']} * {price}"}, task["answer"])]
        for k, (name, arguments, result) in enumerate(steps):
            call = {"id": f"call_{i}_{k}", "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments)}}
            messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": call["id"], "content": result}]
        messages.append({"role": "assistant", "content": f"<answer>{answer}</answer>"})
        out.append(messages)
    return out

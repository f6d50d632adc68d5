"""Preference pairs for the reward-model example (configs/rm_train.toml -> configs/rl_with_rm.toml).

    .venv/bin/python scripts/make_rm_example_data.py            # -> data/rm_example/pairs.jsonl

The task is the quickstart's ``palaestra/Calculator-v0`` (two-digit +, -, *), whose hidden rule
the reward model has to find from pairs alone: *an answer is right when it is the calculator's
result*. Every pair shares a prompt (the env's system and user messages); ``chosen`` calls the
calculator on the question's expression and copies its result into ``<answer>``; ``rejected``
gets one thing wrong (`REJECTED_KINDS`): it guesses without the tool (a number of the same
length, as the quickstart's imperfect demonstrations guess), copies the result wrongly (one digit
changed), asks the calculator about other numbers, or breaks the answer tag. The last three look
like the chosen transcript but for a few characters, so "calls the tool" alone does not separate
the pairs (a first version had only guesses and miscopies: RL against that reward model learned
to call the calculator on any numbers, see docs). Rows are in the DPO format (``{"prompt",
"chosen", "rejected", "kind"}``); the tasks are drawn with their own seed, so they are not the RL
run's held-out tasks (eval.seed = 10000 draws those).
Deterministic: the same arguments write the same file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

ENV_KWARGS: dict[str, Any] = {
    "min_value": 10, "max_value": 99, "num_operations": 1, "operators": ["+", "-", "*"],
    "max_turns": 3,
    "system_prompt": 'Call the calculator as <tool_call>{"name": "calculator", "arguments": '
                     '{"expression": "..."}}</tool_call>, then answer <answer>N</answer>.',
}


def _tool_turns(task: dict[str, Any], i: int, answer: str) -> list[dict[str, Any]]:
    call = {"id": f"call_{i}", "type": "function",
            "function": {"name": "calculator",
                         "arguments": json.dumps({"expression": task["expression"]})}}
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": task["answer"], "tool_call_id": call["id"], "name": "calculator"},
        {"role": "assistant", "content": f"<answer>{answer}</answer>"},
    ]


def _wrong_like(value: str, rng: np.random.Generator) -> str:
    """A different number of the same length (one digit changed, never to a leading zero)."""
    digits = list(value.lstrip("-"))
    k = int(rng.integers(len(digits)))
    choices = [d for d in "0123456789" if d != digits[k] and not (k == 0 and d == "0" and len(digits) > 1)]
    digits[k] = str(rng.choice(choices))
    return ("-" if value.startswith("-") else "") + "".join(digits)


def _malformed(answer: str, rng: np.random.Generator) -> str:
    """The right number in a broken answer tag (the env finds no answer in it)."""
    forms = ("<answer></answer>{}", "{}</answer>", "</answer>{}</answer>", "<answer>{}")
    return str(rng.choice(forms)).format(answer)


#: what a rejected transcript gets wrong, and how often (the rest of the pairs: guessed)
REJECTED_KINDS = {"miscopied": 0.2, "wrong_expression": 0.2, "malformed": 0.15}


def make_pairs(n: int, *, seed: int = 1, hard_fraction: float | None = None) -> list[dict[str, Any]]:
    """``n`` pairs; ``hard_fraction`` (if given) replaces `REJECTED_KINDS` by miscopies only."""
    from palaestra.envs.calculator import CalculatorEnv, make_task

    kinds = REJECTED_KINDS if hard_fraction is None else {"miscopied": hard_fraction}
    rng = np.random.default_rng(seed)
    env = CalculatorEnv(**ENV_KWARGS)
    rows = []
    for i in range(n):
        task = env.sample_task(rng)
        prompt = [m.to_dict() for m in env.initial_messages(task)]
        chosen = _tool_turns(task, i, task["answer"])
        u, kind = rng.random(), "guessed"
        for name, share in kinds.items():
            if u < share:
                kind = name
                break
            u -= share
        if kind == "miscopied":  # the right call, its result copied wrongly
            rejected = _tool_turns(task, i, _wrong_like(task["answer"], rng))
        elif kind == "wrong_expression":  # the calculator asked about other numbers
            other = make_task(rng, 10, 99, 1, [task["expression"].split()[1]])
            rejected = _tool_turns({**task, "expression": other["expression"],
                                    "answer": other["answer"]}, i, other["answer"])
        elif kind == "malformed":
            turns = _tool_turns(task, i, task["answer"])
            turns[-1] = {"role": "assistant", "content": _malformed(task["answer"], rng)}
            rejected = turns
        else:  # a guess without the tool
            rejected = [{"role": "assistant",
                         "content": f"<answer>{_wrong_like(task['answer'], rng)}</answer>"}]
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected, "kind": kind})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data/rm_example/pairs.jsonl")
    parser.add_argument("--num-pairs", type=int, default=3200)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rows = make_pairs(args.num_pairs, seed=args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
    print(f"wrote {len(rows)} pairs to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Preference pairs for the reward-model example (configs/rm_train.toml -> configs/rl_with_rm.toml).

    .venv/bin/python scripts/make_rm_example_data.py            # -> data/rm_example/pairs.jsonl
    .venv/bin/python scripts/make_rm_example_data.py --task calculator --out data/rm_example/calc_pairs.jsonl

Default task: ``palaestra/HiddenRule-v0`` ("Give a number from 340 to 349."), whose true success
needs a rule no prompt states: *the number is even*. The reward model has to find it from pairs
alone: ``chosen`` answers an even number of the range; ``rejected`` gets one thing wrong
(`HIDDEN_REJECTED_KINDS`, half each): an odd neighbour of the chosen number (same range, last
digit off by one: the hidden rule), or the chosen number with one digit of its range changed
(even, but out of the stated range: a first version drew any other range, and RL against it
drifted to picks of the wrong range). The policy's warm start
(`palaestra.envs.hidden_rule.demonstrations`) picks uniformly in the range, so only the reward
model can teach it the rule.

``--task calculator``: the first version's pairs for the quickstart's ``palaestra/Calculator-v0``
(hidden rule: *the answer is the calculator's result*): chosen transcripts call the calculator on
the question and copy its result; rejected ones guess without it, miscopy it, ask about other
numbers or break the answer tag. RL against that reward model hacked it (docs: the second
result), kept here to reproduce it.

Rows are in the DPO format (``{"prompt", "chosen", "rejected", "kind"}``); the tasks are drawn
with their own seed (not the RL run's held-out draw, eval.seed = 10000). Deterministic: the same
arguments write the same file.
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


#: what a rejected calculator transcript gets wrong, and how often (the rest: guessed)
REJECTED_KINDS = {"miscopied": 0.2, "wrong_expression": 0.2, "malformed": 0.15}


def make_calculator_pairs(n: int, *, seed: int = 1, hard_fraction: float | None = None) -> list[dict[str, Any]]:
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


#: what a rejected HiddenRule-v0 answer gets wrong, and how often (the rest: another range)
HIDDEN_REJECTED_KINDS = {"breaks_rule": 0.5}


def _near_decade(value: int, min_decade: int, max_decade: int, rng: np.random.Generator) -> int:
    """``value`` with one digit of its decade changed (its last digit kept): just out of range."""
    decade, last = divmod(value, 10)
    digits = str(decade)
    while True:
        k = int(rng.integers(len(digits)))
        new = digits[:k] + str(int(rng.integers(10))) + digits[k + 1:]
        if new != digits and min_decade <= int(new) <= max_decade:
            return 10 * int(new) + last


def make_hidden_rule_pairs(n: int, *, seed: int = 1, rule: str = "even") -> list[dict[str, Any]]:
    """``n`` pairs for ``palaestra/HiddenRule-v0`` whose chosen answers obey ``rule``."""
    from palaestra.envs.hidden_rule import HiddenRuleEnv, follows_rule

    rng = np.random.default_rng(seed)
    env = HiddenRuleEnv(rule=rule)

    def pick(low: int) -> int:
        return int(rng.choice([v for v in range(low, low + 10) if follows_rule(v, rule)]))

    rows = []
    for _ in range(n):
        task = env.sample_task(rng)
        prompt = [m.to_dict() for m in env.initial_messages(task)]
        good = pick(task["low"])
        if rng.random() < HIDDEN_REJECTED_KINDS["breaks_rule"]:
            kind = "breaks_rule"  # the neighbour that breaks the rule, inside the range
            bad = good + 1 if good + 1 <= task["high"] else good - 1
        else:
            kind = "out_of_range"  # obeys the rule, but one digit of the range is changed
            bad = _near_decade(good, env.min_decade, env.max_decade, rng)
        rows.append({"prompt": prompt,
                     "chosen": [{"role": "assistant", "content": f"<answer>{good}</answer>"}],
                     "rejected": [{"role": "assistant", "content": f"<answer>{bad}</answer>"}],
                     "kind": kind})
    return rows


def make_pairs(n: int, *, seed: int = 1, task: str = "hidden_rule") -> list[dict[str, Any]]:
    """``n`` pairs of ``task`` ("hidden_rule" or "calculator")."""
    if task == "hidden_rule":
        return make_hidden_rule_pairs(n, seed=seed)
    if task == "calculator":
        return make_calculator_pairs(n, seed=seed)
    raise SystemExit(f"--task must be hidden_rule or calculator, got {task!r}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data/rm_example/pairs.jsonl")
    parser.add_argument("--num-pairs", type=int, default=3200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--task", choices=("hidden_rule", "calculator"), default="hidden_rule")
    args = parser.parse_args()
    rows = make_pairs(args.num_pairs, seed=args.seed, task=args.task)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
    print(f"wrote {len(rows)} pairs to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

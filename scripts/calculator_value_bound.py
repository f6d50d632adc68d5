"""How much of the return variance any critic could explain on sampled calculator episodes.

PPO logs the critic's explained variance over the sampled tokens, ``1 - Var(R - V) / Var(R)``
(`palaestra.trainers.ppo.step.value_stats`). On `palaestra/Calculator-v0` the return ``R`` is the
episode's final 0/1 reward, and once a policy calls the tool every time, its failures are single
mis-sampled digits (a wrong operand in the expression, a miscopied result). No critic can see
such a digit before it is sampled, so the explained variance has a ceiling well under 1. This
script estimates that ceiling for a set of episodes, for an *oracle* critic that knows the exact
per-digit error rate and sees every error the instant it is sampled:

- the error rate ``e`` per digit token follows from the success rate ``s`` and the digit tokens
  per episode ``K``: ``(1 - e) ** K = s``;
- before a token, with ``k`` digits still to sample, a not-yet-lost episode succeeds with
  ``q = (1 - e) ** k``, so ``Var(R | prefix) = q (1 - q)``; a lost one is counted as known
  (variance 0) at every token, before its error too, which can only raise the ceiling;
- failures that no digit caused (an answer without a call, a malformed call) can be given with
  ``--early-failures N``: they are then decided by the first sampled token, as early as any
  could be, which raises the ceiling too.

Input: the ``samples.jsonl`` of ``palaestra eval -b calculator --model M --temperature 1.0
--n 4 --out DIR`` (the episodes as the policy samples them in training) and the model's folder
(its tokenizer)::

    python scripts/calculator_value_bound.py DIR/samples.jsonl M
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path


def oracle_explained_variance(episodes: Sequence[tuple[Sequence[bool], float]],
                              early_failures: int = 0) -> dict[str, float]:
    """The ceiling for episodes given as (is-digit flag of each sampled token, 0/1 reward).
    ``early_failures`` of the failures are taken as decided by the first sampled token (a
    failure not caused by a digit, placed as early as it can be, which raises the ceiling)."""
    rewards = [r for _, r in episodes]
    n = len(rewards)
    success = sum(rewards) / n
    var_r = success * (1.0 - success)
    digits = sum(sum(flags) for flags, _ in episodes) / n
    first_token_risk = early_failures / n
    digit_success = success / (1.0 - first_token_risk)
    error = 1.0 - digit_success ** (1.0 / digits) if digits > 0 else 0.0
    left_var = 0.0
    tokens = 0
    for flags, reward in episodes:
        left = sum(flags)
        for index, is_digit in enumerate(flags):
            q = (1.0 - error) ** left * ((1.0 - first_token_risk) if index == 0 else 1.0)
            left_var += q * (1.0 - q) if reward == 1.0 else 0.0
            tokens += 1
            left -= is_digit
    ceiling = 1.0 - left_var / tokens / var_r if var_r > 0 else float("nan")
    return {"episodes": float(len(episodes)), "success": success, "var_return": var_r,
            "digit_tokens_per_episode": digits, "error_per_digit": error,
            "explained_variance_ceiling": ceiling}


def digit_flags(sample: dict, decode) -> list[bool]:  # type: ignore[no-untyped-def]
    """Whether each sampled (loss-masked) token of a trajectory's sample writes a digit."""
    return [any(c.isdigit() for c in decode([t]))
            for i, (t, m) in enumerate(zip(sample["token_ids"], sample["loss_mask"]))
            if m and i >= sample["prompt_len"]]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("samples", type=Path, help="samples.jsonl of `palaestra eval`")
    parser.add_argument("model", help="the evaluated model's folder (for its tokenizer)")
    parser.add_argument("--early-failures", type=int, default=0,
                        help="failures not caused by a digit (no call, a malformed call): "
                        "counted as decided by the first sampled token")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    episodes = []
    for line in args.samples.read_text().splitlines():
        record = json.loads(line)
        flags = [f for s in record["trajectory"]["samples"] for f in digit_flags(s, tokenizer.decode)]
        episodes.append((flags, float(record["reward"] or 0.0)))
    print(json.dumps({k: round(v, 4) for k, v in oracle_explained_variance(episodes, args.early_failures).items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

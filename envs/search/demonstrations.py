"""Imperfect Search-R1 demonstrations for an SFT warm start (the search quickstart).

``warmup.demonstrations = "palaestra.envs.search.demonstrations:demonstrations"``: each
transcript plays one training question of ``questions`` (rows whose ``split`` is not
``"heldout"``) through `SearchR1Env` built from the run's env kwargs, so prompts and
``<information>`` blocks are exactly what the env (and its retriever) produce. A
``search_fraction`` of them search the question's subject and copy the answer from the retrieved
passage (right); the others answer at once "from memory" with some training question's answer
(almost always wrong: the facts are made up). SFT on this mix teaches the protocol and both
behaviours; RL has to find out which one earns reward.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from palaestra.envs.search.env import SearchR1Env, golden_answers, question_of
from palaestra.envs.shipped import iter_jsonl
from palaestra.errors import ConfigError

#: The subject of the quickstart's questions ("Where does person <number> live?").
_SUBJECT = re.compile(r"^Where does person (\d+) live\?$")


def subject_of(question: str) -> str:
    """The number of the person a quickstart question asks about (the query a good search
    uses: it matches that person's passage only)."""
    match = _SUBJECT.match(question)
    if match is None:
        raise ConfigError(f"not a search quickstart question: {question!r}")
    return match.group(1)


def training_rows(questions: str | Path) -> list[dict[str, Any]]:
    """The rows of ``questions`` that training may see (``split`` other than ``"heldout"``)."""
    rows = [r for r in iter_jsonl(questions) if r.get("split") != "heldout"]
    if not rows:
        raise ConfigError(f"{questions} holds no training questions")
    return rows


def demonstrations(
    n: int,
    *,
    seed: int = 0,
    questions: str = "data/search_quickstart/questions.jsonl",
    search_fraction: float = 0.4,
    env_kwargs: Mapping[str, Any] | None = None,
) -> list[list[dict[str, Any]]]:
    """``n`` chat transcripts (OpenAI message dicts) over the training questions."""
    if not 0.0 <= search_fraction <= 1.0:
        raise ConfigError(f"search_fraction must be in [0, 1], got {search_fraction}")
    rows = training_rows(questions)
    answers = sorted({golden_answers(r)[0] for r in rows})
    rng = np.random.default_rng(seed)
    env = SearchR1Env(**dict(env_kwargs or {}))
    dialogues = []
    try:
        for _ in range(n):
            row = rows[int(rng.integers(len(rows)))]
            observation, _ = env.reset(options={"task": row})
            messages = [m.to_dict() for m in observation]
            gold = golden_answers(row)[0]
            if rng.random() < search_fraction:
                search = f"<search> {subject_of(question_of(row))} </search>"
                information, *_ = env.step(search)
                messages.append({"role": "assistant", "content": search})
                messages += [m.to_dict() for m in information]
                messages.append({"role": "assistant", "content": f"<answer> {gold} </answer>"})
            else:
                guess = answers[int(rng.integers(len(answers)))]
                messages.append({"role": "assistant", "content": f"<answer> {guess} </answer>"})
            dialogues.append(messages)
    finally:
        env.close()
    return dialogues


__all__ = ["demonstrations", "subject_of", "training_rows"]

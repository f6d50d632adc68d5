"""Search-R1 demonstrations on the real multi-hop questions, from their own gold paragraphs.

``warmup.demonstrations = "palaestra.envs.search.multihop_demonstrations:demonstrations"`` (the
SmolLM2 Search-R1 recipe, ``configs/search_r1_smollm2.toml``). Each transcript plays one
training question (rows whose ``split`` is not ``"heldout"``) through `SearchR1Env` built from the
run's env kwargs, so prompts and ``<information>`` blocks are exactly what the env and its
retriever produce:

1. ``<search> the question </search>``;
2. when no gold answer shows in what came back, ``<search> title </search>`` with the title of the
   question's gold paragraph (``gold_ids``) that holds the answer: the second hop;
3. ``<answer> gold </answer>``.

Only questions whose answer shows in the retrieved text are demonstrated, so the warm start
teaches searching and copying an answer out of ``<information>``, never answering from nothing.
Held-out rows, and everything only they point to, are never read. `answerable` keeps the
training rows that such searches answer (the recipe's ``data.train_filter``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from palaestra.envs.rewards import normalize_answer
from palaestra.envs.search.corpus import Document, load_corpus
from palaestra.envs.search.demonstrations import training_rows
from palaestra.envs.search.env import SearchR1Env, golden_answers, question_of
from palaestra.errors import ConfigError

#: the training split the SmolLM2 recipe uses (``data/search/SOURCE.md``)
SPLIT_QUESTIONS = "data/search/multihop_split.jsonl.gz"


def _shows(golds: list[str], text: str) -> str | None:
    """The first gold answer that appears (normalised, on word boundaries) in ``text``."""
    haystack = f" {normalize_answer(text)} "
    for gold in golds:
        needle = normalize_answer(gold)
        if needle and f" {needle} " in haystack:
            return gold
    return None


def _second_hop(row: Mapping[str, Any], golds: list[str], by_id: Mapping[str, Document]
                ) -> str | None:
    """The title of the row's gold paragraph that holds a gold answer (the query of hop 2)."""
    for doc_id in row.get("gold_ids", ()):
        doc = by_id.get(str(doc_id))
        if doc is not None and _shows(golds, doc.contents.split("\n", 1)[-1]):
            return doc.title.strip().strip('"')
    return None


def _play(env: SearchR1Env, row: Mapping[str, Any], by_id: Mapping[str, Document]
          ) -> list[dict[str, Any]] | None:
    """One transcript of ``row`` (None when the answer never shows in the retrieved text)."""
    golds = golden_answers(row)
    observation, _ = env.reset(options={"task": row})
    messages = [m.to_dict() for m in observation]
    seen = ""
    queries = [question_of(row)]
    title = _second_hop(row, golds, by_id)
    if title is not None:
        queries.append(title)
    for query in queries[: env.max_turns - 1]:
        search = f"<search> {query} </search>"
        information, *_ = env.step(search)
        messages.append({"role": "assistant", "content": search})
        messages += [m.to_dict() for m in information]
        seen += " ".join(m.content for m in information)
        answer = _shows(golds, seen)
        if answer is not None:
            messages.append({"role": "assistant", "content": f"<answer> {answer} </answer>"})
            return messages
    return None


def _played(rows: list[dict[str, Any]], corpus: str | None,
            env_kwargs: Mapping[str, Any] | None) -> list[tuple[int, list[dict[str, Any]]]]:
    """(index, transcript) of every row of ``rows`` whose answer the searches find."""
    kwargs = dict(env_kwargs or {})
    by_id = {d.id: d for d in load_corpus(corpus if corpus is not None else kwargs.get("corpus"))}
    env = SearchR1Env(**kwargs)
    try:
        plays = ((i, _play(env, row, by_id)) for i, row in enumerate(rows))
        return [(i, t) for i, t in plays if t is not None]
    finally:
        env.close()


def answerable(rows: list[dict[str, Any]], *, env_kwargs: Mapping[str, Any] | None = None,
               corpus: str | None = None) -> list[dict[str, Any]]:
    """The rows whose gold answer the demonstrated searches find (the question, then the title
    of the gold paragraph): ``data.train_filter`` of the SmolLM2 Search-R1 recipe, which trains
    RL on the questions where a search can lead to the answer. Reads only ``rows`` (training
    rows) and the corpus."""
    return [rows[i] for i, _ in _played(rows, corpus, env_kwargs)]


def demonstrations(
    n: int,
    *,
    seed: int = 0,
    questions: str = SPLIT_QUESTIONS,
    corpus: str | None = None,
    env_kwargs: Mapping[str, Any] | None = None,
) -> list[list[dict[str, Any]]]:
    """``n`` chat transcripts (OpenAI message dicts), cycling over the training questions whose
    answer the searches find, in a seeded order."""
    played = [t for _, t in _played(training_rows(questions), corpus, env_kwargs)]
    if not played:
        raise ConfigError(f"no training question of {questions} has its answer in what the "
                          "searches return; check env.kwargs (corpus, topk, passage_words)")
    order = np.random.default_rng(seed).permutation(len(played))
    return [played[int(order[i % len(played)])] for i in range(n)]


__all__ = ["SPLIT_QUESTIONS", "answerable", "demonstrations"]

"""Retrieval quality of a retriever on questions with known gold passages (``gold_ids``).

    python -m palaestra.envs.search.evaluate [--k 3] [--retriever bm25|URL] [--json OUT]

prints hit@k (at least one gold passage among the top k), recall@k (the fraction of a question's
gold passages in the top k, averaged) and all@k (every gold passage in the top k) over the
shipped multi-hop questions, querying with the question text.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from typing import Any

from palaestra.envs.search.retriever import Retriever
from palaestra.envs.search.retrievers import make_retriever
from palaestra.envs.shipped import load_rows


def retrieval_recall(
    retriever: Retriever, rows: Sequence[Mapping[str, Any]], k: int = 3
) -> dict[str, float]:
    """hit@k, recall@k and all@k of ``retriever`` over rows with ``question`` and ``gold_ids``."""
    rows = [r for r in rows if r.get("gold_ids")]
    if not rows:
        return {"n": 0, f"hit@{k}": 0.0, f"recall@{k}": 0.0, f"all@{k}": 0.0}
    results = retriever.search([str(r["question"]) for r in rows], k)
    hit = recall = complete = 0.0
    for row, hits in zip(rows, results):
        gold = {str(g) for g in row["gold_ids"]}
        found = len(gold & {h.document.id for h in hits})
        hit += found > 0
        recall += found / len(gold)
        complete += found == len(gold)
    n = len(rows)
    return {"n": n, f"hit@{k}": hit / n, f"recall@{k}": recall / n, f"all@{k}": complete / n}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="retrieval recall on the shipped multi-hop questions")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--retriever", default="bm25")
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    args = parser.parse_args(argv)
    rows = load_rows("multihop", {"multihop": "search/multihop.jsonl.gz"})
    by_source: dict[str, list[Mapping[str, Any]]] = {"all": [*rows]}
    for row in rows:
        by_source.setdefault(str(row.get("data_source")), []).append(row)
    retriever = make_retriever(args.retriever)
    table = {name: retrieval_recall(retriever, subset, args.k) for name, subset in by_source.items()}
    k = args.k
    print(f"{'questions':<12}{'n':>5}{f'hit@{k}':>9}{f'recall@{k}':>11}{f'all@{k}':>9}")
    for name, m in table.items():
        print(f"{name:<12}{m['n']:>5}{m[f'hit@{k}']:>9.3f}{m[f'recall@{k}']:>11.3f}{m[f'all@{k}']:>9.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

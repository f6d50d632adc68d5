"""Generate the Search-R1 quickstart data: made-up people, one passage each, and questions.

    .venv/bin/python scripts/make_search_quickstart_data.py --out data/search_quickstart

Writes ``corpus.jsonl`` (``{"id", "contents": "person 4821\\nperson 4821 lives in town 583."}``,
one passage per person) and ``questions.jsonl`` (``{"id", "question": "Where does person 4821
live?", "golden_answers": ["town 583", "583"], "split": "train"|"heldout", "gold_ids": [passage
id]}``), the held-out rows last, so that ``eval.num_tasks = --heldout`` makes training's held-out
tail exactly them.

People are distinct random 4-digit numbers and towns 3-digit ones (the quickstart tokenizer
splits digits one by one, so a query or an answer is a short copy a tiny model can learn, as the
calculator quickstart copies numbers). Each town is home to several people, so a person's number
says nothing about their town, and the answer of a held-out question appears nowhere but in that
person's passage (held-out people are never asked about in training). Deterministic for a given
``--seed``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def build(num_train: int, num_heldout: int, num_places: int, seed: int) -> tuple[list, list]:
    """``(corpus rows, question rows)``; held-out question rows come last."""
    rng = random.Random(seed)
    numbers = rng.sample(range(1000, 10000), num_train + num_heldout)
    places = rng.sample(range(100, 1000), num_places)
    corpus, questions = [], []
    for i, number in enumerate(numbers):
        person, place = f"person {number}", f"town {rng.choice(places)}"
        doc_id = f"p{i:04d}"
        corpus.append({"id": doc_id, "contents": f"{person}\n{person} lives in {place}."})
        split = "train" if i < num_train else "heldout"
        questions.append({
            "id": f"sq-{split}-{i:04d}", "question": f"Where does {person} live?",
            "golden_answers": [place, place.split()[1]], "split": split, "gold_ids": [doc_id],
        })
    rng.shuffle(corpus)  # passage order says nothing about the split
    return corpus, questions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("data/search_quickstart"))
    parser.add_argument("--train", type=int, default=500, help="people asked about in training")
    parser.add_argument("--heldout", type=int, default=100, help="people asked about only in eval")
    parser.add_argument("--places", type=int, default=150, help="distinct answers")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    corpus, questions = build(args.train, args.heldout, args.places, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("corpus.jsonl", corpus), ("questions.jsonl", questions)):
        with (args.out / name).open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"wrote {len(corpus)} passages and {len(questions)} questions "
          f"({args.heldout} held out, last) to {args.out}")


if __name__ == "__main__":
    main()

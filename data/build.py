"""Rebuild the shipped data files under ``data/`` from the verbatim copies in ``../shared/data``.

Run from the repository root: ``python data/build.py [--shared ../shared/data]``. The output is
deterministic (gzip with mtime 0, sorted keys), so rebuilding gives byte-identical files.

What it writes (licences and origins in ``data/README.md`` and each folder's ``SOURCE.md``):

- ``search/corpus.jsonl.gz``: the local multi-hop search corpus in the Search-R1/FlashRAG format
  ``{"id", "contents": "\\"Title\\"\\ntext"}``: the paragraphs of HotpotQA (dev first-100 contexts
  and the 100-question train corpus), MuSiQue (1,890), 2WikiMultihopQA (6,119) and the wiki-18
  sample (1,000), de-duplicated on (title, text), ids "0".."N-1" in that order.
- ``search/multihop.jsonl.gz``: the 300 HotpotQA/MuSiQue questions answerable from that corpus as
  Search-R1 rows ``{"id", "question", "golden_answers", "data_source", "gold_ids"}``, where
  ``gold_ids`` are the corpus ids of the supporting paragraphs.
- ``search/multihop_split.jsonl.gz``: the same 300 rows with ``"split"``, for training on them:
  every third row (index 2, 5, 8, ...) is held out (100 rows: 66 HotpotQA, 34 MuSiQue), and the
  held-out rows come last, so a run's ``eval.num_tasks = 100`` tail is exactly them.
- ``search/multihop_more_split.jsonl.gz``: ``multihop_split``'s 300 rows after more training
  questions: those of HotpotQA's 7,405 dev questions (question/answer only) and R1-Searcher's
  2Wiki-500 and MuSiQue-500 that are not among the 300 (by normalised question text), not
  answered yes/no, and whose answer a search of the question brings back from the corpus (BM25,
  3 passages of 40 words: the SmolLM2 Search-R1 recipe's retrieval). Same held-out tail.
- ``search/nq_open_dev.jsonl.gz``: NQ-open dev (3,610 rows ``{"question", "answer"}``), verbatim.
- ``math/gsm8k_{train,test}.jsonl.gz``, ``math/math500_test.jsonl.gz``: verbatim rows.
- ``code/humaneval.jsonl.gz`` (verbatim), ``code/mbpp.jsonl.gz`` (the full 974-task file, verbatim).
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _write_jsonl_gz(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
        f.write(blob)
    print(f"{path}: {len(rows)} rows, {path.stat().st_size:,} bytes")


def _gzip_verbatim(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    data = gzip.decompress(src.read_bytes()) if src.suffix == ".gz" else src.read_bytes()
    with open(dst, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
        f.write(data)
    lines = data.count(b"\n")
    print(f"{dst}: {lines} lines, {dst.stat().st_size:,} bytes")


class Corpus:
    """De-duplicating paragraph pool that hands out sequential string ids."""

    def __init__(self) -> None:
        self.rows: list[dict[str, str]] = []
        self.ids: dict[tuple[str, str], str] = {}

    def add(self, title: str, text: str) -> str:
        key = (title.strip(), text.strip())
        if key not in self.ids:
            doc_id = str(len(self.rows))
            self.ids[key] = doc_id
            self.rows.append({"id": doc_id, "contents": f'"{key[0]}"\n{key[1]}'})
        return self.ids[key]


def build_search(shared: Path, out: Path) -> None:
    corpus = Corpus()
    questions: list[dict[str, Any]] = []

    dev = json.loads((shared / "hotpotqa/hotpot_dev_distractor_first100_hfformat.json").read_text())
    for i, row in enumerate(dev):
        ctx = row["context"]
        by_title = {}
        for title, sentences in zip(ctx["title"], ctx["sentences"]):
            by_title[title] = corpus.add(title, "".join(sentences))
        gold = sorted({by_title[t] for t in row["supporting_facts"]["title"]}, key=int)
        questions.append(
            {"id": f"hotpotqa-dev-{i}", "question": row["question"],
             "golden_answers": [row["answer"]], "data_source": "hotpotqa", "gold_ids": gold}
        )

    train_corpus = json.loads((shared / "hotpotqa/hotpotqa_train_corpus.json").read_text())
    for title, sentences in train_corpus.items():
        corpus.add(title, "".join(sentences))
    for row in json.loads((shared / "hotpotqa/hotpotqa_train.json").read_text()):
        by_title = {title: corpus.add(title, "".join(s)) for title, s in row["context"]}
        gold = sorted({by_title[t] for t, _ in row["supporting_facts"]}, key=int)
        questions.append(
            {"id": row["_id"], "question": row["question"], "golden_answers": [row["answer"]],
             "data_source": "hotpotqa", "gold_ids": gold}
        )

    for para in json.loads((shared / "musique/musique_train_corpus.json").read_text()):
        corpus.add(para["title"], para["text"])
    for row in json.loads((shared / "musique/musique_train.json").read_text()):
        gold = sorted(
            {corpus.add(p["title"], p["paragraph_text"]) for p in row["paragraphs"]
             if p["is_supporting"]},
            key=int,
        )
        answers = [row["answer"]] + [a for a in row["answer_aliases"] if a != row["answer"]]
        questions.append(
            {"id": row["id"], "question": row["question"], "golden_answers": answers,
             "data_source": "musique", "gold_ids": gold}
        )

    for para in json.loads((shared / "2wikimultihopqa_corpus/2wikimultihopqa_corpus.json").read_text()):
        corpus.add(para["title"], para["text"])
    with open(shared / "wiki18_sample/sample_data.jsonl") as f:
        for line in f:
            title, _, text = json.loads(line)["contents"].partition("\n")
            corpus.add(title.strip().strip('"'), text)

    _write_jsonl_gz(out / "search/corpus.jsonl.gz", corpus.rows)
    _write_jsonl_gz(out / "search/multihop.jsonl.gz", questions)
    _gzip_verbatim(shared / "nq_open/NQ-open.dev.jsonl", out / "search/nq_open_dev.jsonl.gz")


def split_multihop(questions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Train rows first, then the held-out ones (every third row, by position in the file)."""
    train = [{**row, "split": "train"} for i, row in enumerate(questions) if i % 3 != 2]
    held_out = [{**row, "split": "heldout"} for i, row in enumerate(questions) if i % 3 == 2]
    return train + held_out


def build_search_split(out: Path) -> None:
    with gzip.open(out / "search/multihop.jsonl.gz", "rt", encoding="utf-8") as f:
        questions = [json.loads(line) for line in f]
    _write_jsonl_gz(out / "search/multihop_split.jsonl.gz", split_multihop(questions))


#: the retrieval that decides which extra questions a search answers (configs/search_r1_smollm2.toml)
RECIPE_RETRIEVAL = {"retriever": "bm25", "topk": 3, "passage_words": 40, "max_turns": 3}


def more_training_questions(shared: Path, out: Path) -> list[dict[str, Any]]:
    """Question/answer rows beyond the 300 whose answer one search of the question finds."""
    from palaestra.envs.rewards import normalize_answer
    from palaestra.envs.search.multihop_demonstrations import answerable

    with gzip.open(out / "search/multihop.jsonl.gz", "rt", encoding="utf-8") as f:
        known = {normalize_answer(json.loads(line)["question"]) for line in f}
    pool: list[dict[str, Any]] = []
    dev = json.loads((shared / "hotpotqa/hotpot_dev_v1_simplified.json").read_text())
    for i, row in enumerate(dev):
        pool.append({"id": f"hotpotqa-devqa-{i}", "question": row["question"],
                     "golden_answers": [row["answer"]], "data_source": "hotpotqa"})
    for name in ("2wiki", "musique"):
        for line in (shared / f"r1searcher_eval_sets/{name}_500.jsonl").read_text().splitlines():
            row = json.loads(line)
            pool.append({"id": f"{name}-r1searcher-{row['idx']}", "question": row["question"],
                         "golden_answers": [row["answer"]], "data_source": name})
    # a yes/no answer is in nearly every passage: "the search found it" would mean nothing
    pool = [r for r in pool if normalize_answer(r["question"]) not in known
            and normalize_answer(r["golden_answers"][0]) not in ("yes", "no")]
    kwargs = {**RECIPE_RETRIEVAL, "corpus": str(out / "search/corpus.jsonl.gz")}
    return answerable(pool, env_kwargs=kwargs)


def build_more_split(shared: Path, out: Path) -> None:
    with gzip.open(out / "search/multihop_split.jsonl.gz", "rt", encoding="utf-8") as f:
        split = [json.loads(line) for line in f]
    extra = [{**row, "split": "train"} for row in more_training_questions(shared, out)]
    _write_jsonl_gz(out / "search/multihop_more_split.jsonl.gz", extra + split)


def build_math_and_code(shared: Path, out: Path) -> None:
    _gzip_verbatim(shared / "gsm8k/train.jsonl", out / "math/gsm8k_train.jsonl.gz")
    _gzip_verbatim(shared / "gsm8k/test.jsonl", out / "math/gsm8k_test.jsonl.gz")
    _gzip_verbatim(shared / "math500/test.jsonl", out / "math/math500_test.jsonl.gz")
    _gzip_verbatim(shared / "humaneval/HumanEval.jsonl.gz", out / "code/humaneval.jsonl.gz")
    _gzip_verbatim(shared / "mbpp/mbpp.jsonl", out / "code/mbpp.jsonl.gz")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", type=Path, default=HERE.parent.parent / "shared/data")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    build_search(args.shared, args.out)
    build_search_split(args.out)
    build_more_split(args.shared, args.out)
    build_math_and_code(args.shared, args.out)


if __name__ == "__main__":
    main()

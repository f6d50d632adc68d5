"""The built-in benchmarks: shipped datasets evaluated through the same envs used for training.

Each is registered whether or not its env exists yet in this installation; `palaestra eval list`
shows the unavailable ones with the reason, and evaluating one fails before any work starts.
"""

from __future__ import annotations

from typing import Any

from palaestra.benchmarks.spec import Benchmark


def _mbpp_test_split(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """MBPP's standard test split: task ids 11-510 of the full 974-task file."""
    return [r for r in rows if 11 <= int(r.get("task_id", 0)) <= 510]


def _source(name: str) -> Any:
    def select(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [r for r in rows if r.get("data_source") == name]

    select.__name__ = f"only_{name}"
    return select


_SEARCH_R1_AGENT = {"family": "search_r1"}

#: env kwargs of the search quickstart (configs/search_r1_quickstart.toml trains with the same);
#: paths are relative to the repository root, where the quickstart runs
SEARCH_QUICKSTART_ENV_KWARGS = {
    "retriever": "bm25",
    "corpus": "data/search_quickstart/corpus.jsonl",
    "topk": 3,
    "max_turns": 3,
    "prompt_template": "Search: <search> number </search>. Answer: <answer> town </answer>.\n"
                       "Question: {question}\n",
}

#: env kwargs of the SmolLM2 Search-R1 recipe (configs/search_r1_smollm2.toml trains with the
#: same): a compact prompt, 3 passages of at most 40 words, 2 searches then an answer
SEARCH_R1_SMOLLM2_ENV_KWARGS = {
    "retriever": "bm25",
    "topk": 3,
    "passage_words": 40,
    "max_turns": 3,
    "prompt_template": "Answer the question. To look something up in Wikipedia, write <search> "
                       "query </search>; the results come back in <information>. Give the final "
                       "answer as <answer> short answer </answer>.\nQuestion: {question}\n",
}
#: the same questions closed-book: no search described, one turn (a search is never run)
CLOSED_BOOK_ENV_KWARGS = {
    "retriever": "bm25",
    "max_turns": 1,
    "prompt_template": "Answer the question. Give the final answer as <answer> short answer "
                       "</answer>.\nQuestion: {question}\n",
}


def _held_out(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A split file's held-out questions (``split == "heldout"``: never trained on)."""
    return [r for r in rows if r.get("split") == "heldout"]


#: the ids of the rows ``multihop_more_split.jsonl.gz`` adds (``data/build.py``), none of which
#: ``multihop_split.jsonl.gz``'s ids (``hotpotqa-dev-N``, HotpotQA's hex ids, MuSiQue's) share
_MULTIHOP_ADDED_ID_PREFIXES = ("hotpotqa-devqa-", "2wiki-r1searcher-", "musique-r1searcher-")


def _multihop_validation(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every fifth of the 328 questions ``multihop_more_split.jsonl.gz`` adds before the 300 of
    ``multihop_split.jsonl.gz`` (66: 57 HotpotQA dev, 9 2Wiki): a validation set for a
    run that trains on ``multihop_split.jsonl.gz``, which never holds them."""
    added = [r for r in rows if str(r.get("id", "")).startswith(_MULTIHOP_ADDED_ID_PREFIXES)]
    return added[::5]


def _search_r1(name: str, dataset: str, description: str, **extra: Any) -> Benchmark:
    """A Search-R1 QA benchmark: tag protocol, exact match on the <answer>."""
    return Benchmark(
        name=name, env_id="palaestra/SearchR1-v0", dataset=dataset, agent=_SEARCH_R1_AGENT,
        chat_stop=("</search>",),  # an API model must not invent the search results
        answer="info", normalize="text", description=description,
        **{"max_new_tokens": 512, **extra},
    )


def _game(name: str, env: str, num_tasks: int, tasks: str, success: str, *,
          max_new_tokens: int = 256) -> Benchmark:
    """A gymnasium toy-text game played as text; success is the env's own."""
    return Benchmark(
        name=name, env_id=f"palaestra/{env}-v0", dataset=None, num_tasks=num_tasks, answer=None,
        max_new_tokens=max_new_tokens,
        description=f"{env} as a text game ({tasks}), success = {success}",
    )


BUILTIN_BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(
        name="gsm8k",
        env_id="palaestra/GSM8K-v0",
        dataset="math/gsm8k_test.jsonl.gz",
        answer="info",
        normalize="numeric",
        max_new_tokens=1024,
        description="GSM8K test (1,319 grade-school word problems), answer graded by value",
    ),
    Benchmark(
        name="math500",
        env_id="palaestra/MATH-v0",
        dataset="math/math500_test.jsonl.gz",
        answer="info",
        normalize="numeric",
        max_new_tokens=2048,
        description="MATH-500 (competition math), \\boxed{} answer graded with math-verify",
    ),
    Benchmark(
        name="humaneval",
        env_id="palaestra/Code-v0",
        dataset="code/humaneval.jsonl.gz",
        answer=None,
        max_new_tokens=1024,
        description="HumanEval (164 Python functions), all hidden tests must pass in the sandbox",
    ),
    Benchmark(
        name="mbpp",
        env_id="palaestra/Code-v0",
        dataset="code/mbpp.jsonl.gz",
        rows=_mbpp_test_split,
        answer=None,
        max_new_tokens=1024,
        description="MBPP test split (tasks 11-510), all asserts must pass in the sandbox",
    ),
    _search_r1(
        "nq_open", "search/nq_open_dev.jsonl.gz",
        "NQ-open dev (3,610 questions), Search-R1 protocol, exact match",
        required_env_kwargs=("retriever",),
        requires=(
            "a retriever over full Wikipedia: --env-kwargs '{\"retriever\": "
            "\"http://HOST:PORT/retrieve\"}' (Search-R1's retrieval server or "
            "`palaestra serve-retriever --corpus YOUR_WIKI.jsonl`)"
        ),
    ),
    _search_r1(
        "hotpotqa", "search/multihop.jsonl.gz",
        "HotpotQA multi-hop questions over the shipped corpus (BM25), exact match",
        rows=_source("hotpotqa"),
    ),
    _search_r1(
        "musique", "search/multihop.jsonl.gz",
        "MuSiQue multi-hop questions over the shipped corpus (BM25), exact match",
        rows=_source("musique"),
    ),
    _search_r1(
        "search_r1_quickstart", "search_quickstart/questions.jsonl",
        "search quickstart: 100 held-out questions about made-up people, answers only in "
        "data/search_quickstart/corpus.jsonl (BM25), exact match",
        rows=_held_out, env_kwargs=SEARCH_QUICKSTART_ENV_KWARGS,
    ),
    _search_r1(
        "multihop_heldout", "search/multihop_split.jsonl.gz",
        "the 100 held-out HotpotQA/MuSiQue questions of data/search/multihop_split.jsonl.gz "
        "(never trained on by configs/search_r1_smollm2.toml), searching the shipped corpus "
        "(BM25) with that recipe's prompt and budgets, exact match",
        rows=_held_out, env_kwargs=SEARCH_R1_SMOLLM2_ENV_KWARGS, num_tasks=100,
        max_new_tokens=64,
    ),
    _search_r1(
        "multihop_validation", "search/multihop_more_split.jsonl.gz",
        "66 HotpotQA/2Wiki questions that data/search/multihop_split.jsonl.gz does not hold "
        "(every fifth question data/search/multihop_more_split.jsonl.gz adds), with that "
        "recipe's prompt and budgets: a validation set to select a multihop_split run's "
        "checkpoint on (benchmark_eval.keep_best), exact match",
        rows=_multihop_validation, env_kwargs=SEARCH_R1_SMOLLM2_ENV_KWARGS, max_new_tokens=64,
    ),
    _search_r1(
        "multihop_closed_book", "search/multihop_split.jsonl.gz",
        "the same 100 held-out questions closed-book: no search, one answer, exact match",
        rows=_held_out, env_kwargs=CLOSED_BOOK_ENV_KWARGS, num_tasks=100, max_new_tokens=64,
    ),
    Benchmark(
        name="calculator",
        env_id="palaestra/Calculator-v0",
        dataset=None,
        num_tasks=200,
        answer="tag",
        normalize="numeric",
        max_new_tokens=256,
        description="arithmetic with a calculator tool (tasks generated from seeds 0..199)",
    ),
    _game("frozenlake", "FrozenLake", 100, "maps from seeds 0..99", "goal reached"),
    _game("taxi", "Taxi", 100, "seeds 0..99", "passenger delivered"),
    _game("blackjack", "Blackjack", 200, "seeds 0..199", "hand won", max_new_tokens=128),
    _game("cliffwalking", "CliffWalking", 50, "seeds 0..49", "goal reached"),
)

__all__ = ["BUILTIN_BENCHMARKS", "SEARCH_QUICKSTART_ENV_KWARGS"]

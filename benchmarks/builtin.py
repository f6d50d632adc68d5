"""The built-in benchmarks: shipped datasets evaluated through the same envs used for training.

Each is registered whether or not its env exists yet in this installation; `palaestra eval list`
shows the unavailable ones with the reason, and evaluating one fails before any work starts.
"""

from __future__ import annotations

from typing import Any

from palaestra.benchmarks.registry import Benchmark


def _mbpp_test_split(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """MBPP's standard test split: task ids 11-510 of the full 974-task file."""
    return [r for r in rows if 11 <= int(r.get("task_id", 0)) <= 510]


def _source(name: str) -> Any:
    def select(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [r for r in rows if r.get("data_source") == name]

    select.__name__ = f"only_{name}"
    return select


_SEARCH_R1_AGENT = {"family": "search_r1"}

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
    Benchmark(
        name="nq_open",
        env_id="palaestra/SearchR1-v0",
        dataset="search/nq_open_dev.jsonl.gz",
        agent=_SEARCH_R1_AGENT,
        chat_stop=("</search>",),  # an API model must not invent the search results
        answer="info",
        normalize="text",
        max_new_tokens=512,
        description="NQ-open dev (3,610 questions), Search-R1 protocol, exact match",
        required_env_kwargs=("retriever",),
        requires=(
            "a retriever over full Wikipedia: --env-kwargs '{\"retriever\": "
            "\"http://HOST:PORT/retrieve\"}' (Search-R1's retrieval server or "
            "`palaestra serve-retriever --corpus YOUR_WIKI.jsonl`)"
        ),
    ),
    Benchmark(
        name="hotpotqa",
        env_id="palaestra/SearchR1-v0",
        dataset="search/multihop.jsonl.gz",
        rows=_source("hotpotqa"),
        agent=_SEARCH_R1_AGENT,
        chat_stop=("</search>",),  # an API model must not invent the search results
        answer="info",
        normalize="text",
        max_new_tokens=512,
        description="HotpotQA multi-hop questions over the shipped corpus (BM25), exact match",
    ),
    Benchmark(
        name="musique",
        env_id="palaestra/SearchR1-v0",
        dataset="search/multihop.jsonl.gz",
        rows=_source("musique"),
        agent=_SEARCH_R1_AGENT,
        chat_stop=("</search>",),  # an API model must not invent the search results
        answer="info",
        normalize="text",
        max_new_tokens=512,
        description="MuSiQue multi-hop questions over the shipped corpus (BM25), exact match",
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
    Benchmark(
        name="frozenlake",
        env_id="palaestra/FrozenLake-v0",
        dataset=None,
        num_tasks=100,
        answer=None,
        max_new_tokens=256,
        description="FrozenLake as a text game (maps from seeds 0..99), success = goal reached",
    ),
    Benchmark(
        name="taxi",
        env_id="palaestra/Taxi-v0",
        dataset=None,
        num_tasks=100,
        answer=None,
        max_new_tokens=256,
        description="Taxi as a text game (seeds 0..99), success = passenger delivered",
    ),
    Benchmark(
        name="blackjack",
        env_id="palaestra/Blackjack-v0",
        dataset=None,
        num_tasks=200,
        answer=None,
        max_new_tokens=128,
        description="Blackjack as a text game (seeds 0..199), success = hand won",
    ),
    Benchmark(
        name="cliffwalking",
        env_id="palaestra/CliffWalking-v0",
        dataset=None,
        num_tasks=50,
        answer=None,
        max_new_tokens=256,
        description="CliffWalking as a text game (seeds 0..49), success = goal reached",
    ),
)

__all__ = ["BUILTIN_BENCHMARKS"]

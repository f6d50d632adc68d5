"""Fixtures of the evaluation tests: the tiny tokenizer and a deterministic "gold answer" engine.

`GoldEngine` is a real `Engine` (token ids in, token ids out) that knows no model: it decodes the
prompt with the tokenizer, finds which task's question it contains, and answers with the token ids
of ``\\boxed{gold}`` (or a wrong number) according to a rule the test chooses, so the accuracy the
harness must report is known exactly in advance.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random-init "micro" Qwen3 checkpoint with the tiny tokenizer (built once, no download)."""
    import torch

    from palaestra.tiny_model import build_model

    torch.set_num_threads(1)
    return str(build_model(tmp_path_factory.mktemp("micro-model"), "micro"))


@pytest.fixture(scope="session")
def tokenizer(model_dir: str) -> Any:
    from palaestra.agents import load_tokenizer

    return load_tokenizer(model_dir)


#: decide(question, sampling_seed, request_number_for_this_question) -> answer correctly?
Decide = Callable[[str, "int | None", int], bool]


class GoldEngine:
    """Answers ``\\boxed{gold}`` when ``decide`` says so, else ``\\boxed{gold + 1}``."""

    def __init__(
        self,
        tokenizer: Any,
        golds: Mapping[str, str],
        decide: Decide,
        *,
        gate: asyncio.Event | None = None,
        block_after: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.golds = dict(golds)
        self.decide = decide
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.requests = 0
        self.per_question: dict[str, int] = {}
        self.block_after = block_after  # requests after this many wait on `gate` forever
        self.gate = gate
        self.healthy = True

    @property
    def weight_version(self) -> int:
        return 0

    def _question(self, text: str) -> str:
        found = [q for q in self.golds if q in text]
        if len(found) != 1:
            raise AssertionError(f"prompt matches {len(found)} known questions")
        return found[0]

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: Any,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> Any:
        from palaestra.engine import Generation

        self.requests += 1
        if self.block_after is not None and self.requests > self.block_after:
            assert self.gate is not None
            await self.gate.wait()
        await asyncio.sleep(0)
        question = self._question(self.tokenizer.decode(list(input_ids)))
        count = self.per_question.get(question, 0)
        self.per_question[question] = count + 1
        gold = self.golds[question]
        answer = gold if self.decide(question, sampling.seed, count) else str(int(gold) + 1)
        ids = [*self.tokenizer.encode(f"So the answer is \\boxed{{{answer}}}."), self.end_id]
        ids = ids[: sampling.max_new_tokens]
        return Generation(
            token_ids=tuple(ids),
            logprobs=tuple(-0.5 for _ in ids),
            finish_reason="stop" if ids[-1] == self.end_id else "length",
            prompt_tokens=len(input_ids),
        )

    async def health(self) -> bool:
        return self.healthy

    async def close(self) -> None:
        pass


@pytest.fixture(scope="session")
def gsm8k_rows() -> list[dict[str, Any]]:
    from palaestra.benchmarks import get_benchmark, load_tasks

    return [row for _, row, _ in load_tasks(get_benchmark("gsm8k"), limit=20)]


@pytest.fixture
def gold_engine(tokenizer: Any, gsm8k_rows: list[dict[str, Any]]) -> Callable[..., GoldEngine]:
    from palaestra.envs.math import gsm8k_gold

    golds = {row["question"].strip(): gsm8k_gold(row) for row in gsm8k_rows}

    def build(decide: Decide, **kwargs: Any) -> GoldEngine:
        return GoldEngine(tokenizer, golds, decide, **kwargs)

    return build


@pytest.fixture
def token_policy(tokenizer: Any) -> Callable[..., Any]:
    from palaestra.benchmarks.policies import TokenPolicy

    def build(engine: Any, model: str = "gold-model") -> Any:
        return TokenPolicy(engine, tokenizer, model=model, family="qwen", max_context=2048)

    return build

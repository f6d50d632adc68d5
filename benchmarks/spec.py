"""`Benchmark`: one evaluation benchmark as a frozen record (dataset, env id and kwargs, prompt
template, answer extraction, metrics); `palaestra.benchmarks.registry` registers and finds them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from palaestra.errors import ConfigError


#: Reads a comparable answer from a finished trajectory (for maj@k); None = no answer given.
AnswerFn = Callable[[Any], "Hashable | None"]
#: Rows -> rows: select a split, rename fields into the env's task format.
RowsFn = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


def _frozen(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(value or {}))


@dataclass(frozen=True)
class Benchmark:
    """One evaluation benchmark.

    ``dataset``: the name of a shipped file relative to palaestra's ``data/`` folder
    (``"math/gsm8k_test.jsonl.gz"``), the path of a JSON-lines file, a callable returning rows, or
    None for envs that generate their tasks from the seed (then ``num_tasks`` seeds 0..N-1 are the
    tasks). ``prompt_template`` is a `str.format` template over the task row plus ``{prompt}`` (the
    user message the env wrote); ``system_prompt`` replaces the env's system message.
    ``answer`` says how maj@k reads a comparable answer: ``"info"`` (the env's
    ``info["extracted_answer"]``), ``"boxed"``, ``"hash"`` (``#### N``), ``"tag"``
    (``<answer>``), a callable on the `Trajectory`, or None (no maj@k). ``normalize`` is
    ``"numeric"``, ``"text"`` (SQuAD normalisation), ``"exact"`` or a callable.
    A sample is correct when its reward is at least ``success_threshold`` (or, when the env reports
    ``info["correct"]`` on the last turn, when that is true).
    """

    name: str
    env_id: str
    dataset: str | Path | Callable[[], Iterable[Mapping[str, Any]]] | None = None
    env_kwargs: Mapping[str, Any] = field(default_factory=dict)
    prompt_template: str | None = None
    system_prompt: str | None = None
    agent: Mapping[str, Any] = field(default_factory=dict)
    answer: str | AnswerFn | None = "info"
    normalize: str | Callable[[str], Hashable | None] = "exact"
    success_threshold: float = 1.0
    rows: RowsFn | None = None
    num_tasks: int = 500
    max_turns: int | None = None
    max_new_tokens: int = 1024
    description: str = ""
    requires: str | None = None  # what the user must supply, shown when it is missing
    required_env_kwargs: tuple[str, ...] = ()  # env kwargs the user must give (e.g. a retriever)
    chat_stop: tuple[str, ...] = ()  # stop strings for chat APIs (message-level path only)

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or any(c.isspace() for c in self.name):
            raise ConfigError(
                f"benchmark name {self.name!r} must be non-empty, without '/' or spaces"
            )
        if not self.env_id:
            raise ConfigError(f"benchmark {self.name!r} needs an env_id")
        object.__setattr__(self, "env_kwargs", _frozen(self.env_kwargs))
        object.__setattr__(self, "agent", _frozen(self.agent))
        if isinstance(self.answer, str) and self.answer not in ANSWER_KINDS:
            raise ConfigError(
                f"benchmark {self.name!r}: answer={self.answer!r}; use one of {ANSWER_KINDS}, "
                "a callable or None"
            )
        if isinstance(self.normalize, str) and self.normalize not in NORMALIZE_KINDS:
            raise ConfigError(
                f"benchmark {self.name!r}: normalize={self.normalize!r}; use one of "
                f"{NORMALIZE_KINDS} or a callable"
            )

    def with_overrides(self, **changes: Any) -> Benchmark:
        """A copy with some fields replaced (e.g. ``dataset=`` a user file, more env kwargs)."""
        from dataclasses import replace

        return replace(self, **changes)


ANSWER_KINDS = ("info", "boxed", "hash", "tag")
NORMALIZE_KINDS = ("exact", "numeric", "text")


__all__ = ["ANSWER_KINDS", "NORMALIZE_KINDS", "AnswerFn", "Benchmark", "RowsFn"]

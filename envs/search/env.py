"""Search-R1 environments: ``palaestra/SearchR1-v0`` (tags) and ``palaestra/SearchR1Tools-v0``.

See the package docstring (`palaestra.envs.search`) for the task, tools, reward, data and licences.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from palaestra.envs.base import MultiTurnEnv, StepResult
from palaestra.envs.rewards import (
    exact_match,
    extract_tag,
    f1_score,
    normalize_answer,
    sub_exact_match,
)
from palaestra.envs.search.corpus import Hit, format_hits
from palaestra.envs.search.retriever import Retriever
from palaestra.envs.search.retrievers import make_retriever
from palaestra.envs.shipped import load_rows
from palaestra.envs.tool_env import ToolEnv
from palaestra.envs.tools import tool
from palaestra.errors import ConfigError
from palaestra.types import Message

#: The Search-R1 instruction ("base" template of PeterGriffinJin/Search-R1, Apache-2.0), kept word
#: for word so that checkpoints trained with Search-R1 see the prompt they were trained on.
SEARCH_R1_PROMPT = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first "
    "every time you get new information. After reasoning, if you find you lack some knowledge, "
    "you can call a search engine by <search> query </search> and it will return the top "
    "searched results between <information> and </information>. You can search as many times "
    "as your want. If you find no further external knowledge needed, you can directly provide "
    "the answer inside <answer> and </answer>, without detailed illustrations. For example, "
    "<answer> Beijing </answer>. Question: {question}\n"
)
#: Search-R1's reply to an action with neither a search nor an answer.
INVALID_ACTION_MESSAGE = (
    "\nMy previous action is invalid. If I want to search, I should put the query between "
    "<search> and </search>. If I want to give the final answer, I should put the answer between "
    "<answer> and </answer>. Let's try again.\n"
)
TOOLS_SYSTEM_PROMPT = (
    "Answer the user's question. Use the search tool to look facts up in Wikipedia (search as "
    "often as you need). When you know the answer, reply with it inside <answer> and </answer>, "
    "as a short phrase without explanation."
)

DATASETS = {
    "multihop": "search/multihop.jsonl.gz",
    "nq_open": "search/nq_open_dev.jsonl.gz",
}
_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


def golden_answers(task: Mapping[str, Any]) -> list[str]:
    """Gold answers of a Search-R1 (``golden_answers``) or NQ-open (``answer``) row."""
    for key in ("golden_answers", "answer", "answers", "target"):
        if key in task and task[key] is not None:
            value = task[key]
            answers = [value] if isinstance(value, str) else [str(v) for v in value]
            if answers:
                return answers
    raise ConfigError(
        "a search task needs gold answers: {'question': ..., 'golden_answers': [...]} "
        f"(or NQ-open's 'answer'); got keys {sorted(task)}"
    )


def question_of(task: Mapping[str, Any]) -> str:
    """The question, stripped and ending in '?' (Search-R1's preprocessing)."""
    question = task.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ConfigError(f"a search task needs a non-empty 'question'; got keys {sorted(task)}")
    question = question.strip()
    return question if question.endswith("?") else question + "?"


def qa_metrics(answer: str | None, golds: Sequence[str], retrieved: Sequence[str] | None = None
               ) -> dict[str, Any]:
    """The answer's EM, sub-EM and token F1 against ``golds``, with the answer and the gold
    answers themselves (an eval record shows what the right answer was); given the texts the
    searches returned, also ``answer_in_retrieved``: 1.0 when the answer appears in them."""
    metrics = {
        "answer": answer,
        "gold": list(golds),
        "em": exact_match(answer, golds),
        "sub_em": sub_exact_match(answer, golds),
        "f1": f1_score(answer, golds),
    }
    if retrieved is not None:
        metrics["answer_in_retrieved"] = float(answer_in_texts(answer, retrieved))
    return metrics


def answer_in_texts(answer: str | None, texts: Sequence[str]) -> bool:
    """Whether ``answer`` (SQuAD-normalised, as whole words) appears in one of ``texts``: the
    answer came from a retrieved passage, not from the model's memory."""
    needle = normalize_answer(answer or "")
    return bool(needle) and any(f" {needle} " in f" {normalize_answer(t)} " for t in texts)


class _SearchTaskMixin:
    """Dataset and retriever handling shared by the two Search-R1 envs."""

    task_fields: ClassVar[tuple[str | tuple[str, ...], ...]] = (
        "question", ("golden_answers", "answer", "answers", "target"))

    _retriever: Retriever | None
    dataset_source: str | Path

    def _init_search(
        self,
        retriever: str | Retriever,
        corpus: str | Path | None,
        topk: int,
        retriever_timeout_s: float,
        passage_words: int | None = None,
    ) -> None:
        if topk < 1:
            raise ConfigError(f"topk must be >= 1, got {topk}")
        if passage_words is not None and passage_words < 1:
            raise ConfigError(f"passage_words must be >= 1 (or unset: whole passages), got "
                              f"{passage_words}")
        self.passage_words = passage_words
        if not isinstance(retriever, Retriever) and retriever != "bm25" and not str(
            retriever
        ).startswith(("http://", "https://")):
            make_retriever(retriever)  # raises the explanatory ConfigError now, not mid-episode
        self.retriever_spec = retriever
        self.corpus = corpus
        self.topk = topk
        self.retriever_timeout_s = retriever_timeout_s
        self._retriever = None

    @property
    def retriever(self) -> Retriever:
        """Created on first search, so listing or checking the env builds no index."""
        if self._retriever is None:
            self._retriever = make_retriever(
                self.retriever_spec, corpus=self.corpus, timeout_s=self.retriever_timeout_s
            )
        return self._retriever

    def load_dataset(self) -> Sequence[Mapping[str, Any]]:
        return load_rows(self.dataset_source, DATASETS)


def _split_dataset(dataset: Any) -> tuple[str | Path, Sequence[Mapping[str, Any]] | None]:
    if isinstance(dataset, (str, Path)):
        return dataset, None
    return "(rows)", dataset


class SearchR1Env(_SearchTaskMixin, MultiTurnEnv):
    """Search-R1: reason, <search> a Wikipedia corpus, <answer>; exact-match reward.

    Text actions (``env.step(str)``) parse like the ``search_r1`` agent family does.

    Task: a question from ``{"question", "golden_answers": [...]}`` (NQ-open's
    ``{"question", "answer": [...]}`` is accepted). The prompt is Search-R1's instruction as one
    user message.
    Actions: each assistant turn is read like Search-R1 does: the first ``<search>q</search>`` or
    ``<answer>a</answer>`` tag decides. A search returns a user message
    ``<information>Doc 1(Title: "T") text\\nDoc 2(...)...</information>`` with the ``topk`` best
    passages; an answer ends the episode; anything else gets Search-R1's "My previous action is
    invalid" message. On the last of ``max_turns`` turns a search is not run (the episode is out
    of turns).
    Reward: 1.0 when the last ``<answer>`` of the answering turn matches any gold answer exactly
    after SQuAD normalisation (lower-case, no punctuation or articles, collapsed whitespace), else
    ``format_reward`` (default 0.0, Search-R1's ``format_score``) when an answer was given, else
    0. ``reward="f1"`` gives a wrong answer its token F1 against the best gold instead (partial
    credit, a denser signal; at least ``format_reward``); ``em`` in the info stays exact match.
    Info carries ``em``, ``sub_em``, ``f1``, ``answer``, ``gold``, ``answer_in_retrieved``,
    ``searches``, ``invalid_actions``.
    Retriever: ``"bm25"`` (a local BM25 index over ``corpus``, default the shipped one, built and
    cached on first search) or the URL of a Search-R1 retrieval server
    (``palaestra serve-retriever`` or Search-R1's own ``retrieval_server.py``);
    ``passage_words`` cuts each returned passage to its first that many words (a token budget).
    Data: ``dataset="multihop"`` (default): 300 HotpotQA (CC BY-SA 4.0) and MuSiQue (CC BY 4.0)
    questions answerable from the shipped corpus of 10,991 Wikipedia paragraphs (CC BY-SA;
    HotpotQA, MuSiQue, 2WikiMultihopQA (Apache-2.0) and a wiki-18 sample); ``dataset="nq_open"``:
    the 3,610 NQ-open dev questions (CC BY-SA 3.0), meant for a full-Wikipedia retriever given by
    URL; or the path of a JSONL file of task rows. See ``data/search/SOURCE.md``.
    """

    tool_call_format: ClassVar[str] = "search_r1"

    step_in_thread: ClassVar[bool] = False
    snapshot_exclude: ClassVar[tuple[str, ...]] = ("_retriever", "_dataset")

    def __init__(
        self,
        *,
        dataset: str | Path | Sequence[Mapping[str, Any]] = "multihop",
        retriever: str | Retriever = "bm25",
        corpus: str | Path | None = None,
        topk: int = 3,
        max_turns: int = 4,
        format_reward: float = 0.0,
        retriever_timeout_s: float = 30.0,
        prompt_template: str = SEARCH_R1_PROMPT,
        passage_words: int | None = None,
        reward: str = "em",
        **kwargs: Any,
    ) -> None:
        source, rows = _split_dataset(dataset)
        super().__init__(max_turns=max_turns, dataset=rows, **kwargs)
        self.dataset_source = source
        self._init_search(retriever, corpus, topk, retriever_timeout_s, passage_words)
        if "{question}" not in prompt_template:
            raise ConfigError("prompt_template must contain '{question}'")
        if reward not in REWARD_METRICS:
            raise ConfigError(f"reward = {reward!r}: use one of {sorted(REWARD_METRICS)} "
                              "('em': Search-R1's exact match; 'f1': token F1, partial credit)")
        self.prompt_template = prompt_template
        self.format_reward = float(format_reward)
        self.reward_metric = reward
        self.searches = 0
        self.invalid_actions = 0

    def on_reset(self, task: Mapping[str, Any]) -> None:
        golden_answers(task)  # validate the row now, not at the end of the episode
        self.searches = 0
        self.invalid_actions = 0
        self.retrieved: list[str] = []  # what the searches returned, for answer_in_retrieved

    def initial_messages(self, task: Mapping[str, Any]) -> list[Message]:
        return [Message(role="user", content=self.prompt_template.format(question=question_of(task)))]

    # ----- steps ----------------------------------------------------------------------------
    def respond(self, action: Message) -> StepResult:
        query = self._query_of(action)
        hits = self.retriever.search([query], self.topk)[0] if query is not None else None
        return self._respond(action, hits)

    async def arespond(self, action: Message) -> StepResult:
        query = self._query_of(action)
        hits = (await self.retriever.asearch([query], self.topk))[0] if query is not None else None
        return self._respond(action, hits)

    async def aon_action(self, action: Message) -> StepResult:
        return self._with_rewards(action, await self.arespond(action))

    @staticmethod
    def parse_action(text: str) -> tuple[str, str] | None:
        """``("search"|"answer", content)`` of the first action tag, or None."""
        match = _ACTION.search(text)
        return (match.group(1), match.group(2).strip()) if match else None

    def _query_of(self, action: Message) -> str | None:
        """The query to run for this action (None: not a search, or out of turns)."""
        parsed = self.parse_action(action.content)
        if parsed is None or parsed[0] != "search" or not parsed[1]:
            return None
        return parsed[1] if self.turn < self.max_turns else None

    def _respond(self, action: Message, hits: list[Hit] | None) -> StepResult:
        assert self.task is not None
        parsed = self.parse_action(action.content)
        last_turn = self.turn >= self.max_turns
        if parsed is not None and parsed[0] == "answer":
            return self._finish(extract_tag(action.content, "answer"), terminated=True)
        if hits is not None:
            self.searches += 1
            # "tool_calls" as ToolEnv reports it: the rollout metrics count searches per episode
            info = {"search_query": parsed[1] if parsed else "", "searches": self.searches}
            content = f"<information>{format_hits(hits, self.passage_words)}</information>"
            self.retrieved.append(content)
            return StepResult(observation=[Message(role="user", content=content)], info=info,
                              tool_calls=1)
        if last_turn:  # a search (or nothing) on the last turn: out of turns, no answer
            return self._finish(None, terminated=False)
        self.invalid_actions += 1
        return StepResult(
            observation=[Message(role="user", content=INVALID_ACTION_MESSAGE)],
            info={"invalid_action": True, "invalid_actions": self.invalid_actions},
        )

    def _finish(self, answer: str | None, *, terminated: bool) -> StepResult:
        assert self.task is not None
        metrics = qa_metrics(answer, golden_answers(self.task), self.retrieved)
        if metrics["em"] == 1.0:
            reward = 1.0
        elif answer is not None:  # f1: the best gold's token F1 (below 1 unless exact)
            partial = metrics["f1"] if self.reward_metric == "f1" else 0.0
            reward = max(partial, self.format_reward)
        else:
            reward = 0.0
        info = {**metrics, "searches": self.searches, "invalid_actions": self.invalid_actions}
        return StepResult(reward=reward, terminated=terminated, info=info)


#: what ``SearchR1Env(reward=...)`` scores a wrong answer by
REWARD_METRICS = frozenset({"em", "f1"})


class SearchR1ToolsEnv(_SearchTaskMixin, ToolEnv):
    """Search-R1 for chat models: a search function tool, <answer>; exact-match reward.

    Task and data: as ``palaestra/SearchR1-v0`` (``dataset="multihop"`` by default, ``"nq_open"``
    or a JSONL path; rows ``{"question", "golden_answers"}``).
    Tools: ``search(query)`` returns the ``topk`` best passages rendered as Search-R1 does
    (``Doc 1(Title: "T") text``) in a tool message.
    Reward: the final assistant message (one without tool calls) is the answer: the content of
    its last ``<answer>...</answer>`` (the whole message when it has no tags); 1.0 on an exact
    match with any gold answer after SQuAD normalisation, else 0. Info: ``em``, ``sub_em``,
    ``f1``, ``answer``, ``gold``, ``answer_in_retrieved``. Licences: see ``palaestra/SearchR1-v0``.
    """

    snapshot_exclude: ClassVar[tuple[str, ...]] = ("_tools", "_retriever", "_dataset")

    def __init__(
        self,
        *,
        dataset: str | Path | Sequence[Mapping[str, Any]] = "multihop",
        retriever: str | Retriever = "bm25",
        corpus: str | Path | None = None,
        topk: int = 3,
        max_turns: int = 6,
        retriever_timeout_s: float = 30.0,
        system_prompt: str = TOOLS_SYSTEM_PROMPT,
        passage_words: int | None = None,
        **kwargs: Any,
    ) -> None:
        source, rows = _split_dataset(dataset)
        super().__init__(max_turns=max_turns, dataset=rows, **kwargs)
        self.dataset_source = source
        self._init_search(retriever, corpus, topk, retriever_timeout_s, passage_words)
        self.system_prompt = system_prompt

    def on_reset(self, task: Mapping[str, Any]) -> None:
        super().on_reset(task)
        golden_answers(task)
        self.retrieved: list[str] = []  # what the searches returned, for answer_in_retrieved

    def initial_messages(self, task: Mapping[str, Any]) -> list[Message]:
        return [
            Message(role="system", content=self.system_prompt),
            Message(role="user", content=question_of(task)),
        ]

    @tool
    async def search(self, query: str) -> str:
        """Search Wikipedia and return the most relevant passages.

        Args:
            query: what to look for, e.g. "Scott Derrickson nationality".
        """
        if not query.strip():
            raise ValueError("the query is empty; write what to look for")
        hits = (await self.retriever.asearch([query], self.topk))[0]
        text = format_hits(hits, self.passage_words)
        self.retrieved.append(text)
        return text or "No results."

    def _metrics(self, action: Message) -> dict[str, Any]:
        assert self.task is not None
        answer = extract_tag(action.content, "answer")
        if answer is None:
            answer = action.content.strip()
        return qa_metrics(answer, golden_answers(self.task), self.retrieved)

    def score(self, action: Message) -> float:
        return self._metrics(action)["em"]

    async def arespond(self, action: Message) -> StepResult:
        if action.tool_calls:
            return await super().arespond(action)
        metrics = self._metrics(action)
        return StepResult(reward=metrics["em"], terminated=True, info=metrics)

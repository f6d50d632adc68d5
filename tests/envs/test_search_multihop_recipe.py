"""The SmolLM2 Search-R1 recipe's data: the fixed split, the gold-paragraph demonstrations, the
held-out benchmarks, and the answer-came-from-a-passage metric."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from palaestra.benchmarks.builtin import CLOSED_BOOK_ENV_KWARGS, SEARCH_R1_SMOLLM2_ENV_KWARGS
from palaestra.benchmarks.envpool import load_tasks
from palaestra.benchmarks.registry import get_benchmark
from palaestra.envs.rewards import normalize_answer
from palaestra.envs.search import SearchR1Env, shared_bm25
from palaestra.envs.search.env import answer_in_texts, qa_metrics, question_of
from palaestra.envs.search.multihop_demonstrations import answerable, demonstrations
from palaestra.envs.shipped import iter_jsonl, load_rows
from palaestra.rollout.data import load_rows as load_data_rows
from palaestra.rollout.data import split_held_out

ROOT = Path(__file__).resolve().parents[2]
SPLIT = ROOT / "data/search/multihop_split.jsonl.gz"
MORE = ROOT / "data/search/multihop_more_split.jsonl.gz"
RECIPE = ROOT / "configs/search_r1_smollm2.toml"


@pytest.fixture(scope="module")
def bm25():
    retriever = shared_bm25()
    retriever.search(["warm up"], 1)
    return retriever


def test_the_split_holds_out_every_third_question_last() -> None:
    original = load_rows("multihop", {"multihop": "search/multihop.jsonl.gz"})
    rows = load_data_rows(SPLIT)
    train, held_out = split_held_out(rows, 100)  # what a run with eval.num_tasks = 100 does
    assert [r["id"] for r in held_out] == [r["id"] for r in original[2::3]]
    assert {r["split"] for r in held_out} == {"heldout"} and {r["split"] for r in train} == {"train"}
    assert not {r["id"] for r in train} & {r["id"] for r in held_out}
    assert not {r["question"] for r in train} & {r["question"] for r in held_out}
    assert len(train) == 200


def test_the_extra_training_questions_keep_the_held_out_tail_and_a_search_answers_them(
        bm25) -> None:
    train, held_out = split_held_out(load_data_rows(MORE), 100)
    assert held_out == split_held_out(load_data_rows(SPLIT), 100)[1]
    # never trained on, even as a reworded duplicate that normalises to the same text
    held_out_questions = {normalize_answer(r["question"]) for r in held_out}
    assert not {normalize_answer(r["question"]) for r in train} & held_out_questions
    extra = [r for r in train if "gold_ids" not in r]
    assert len(extra) == len(train) - 200 > 200
    assert not [r for r in extra if normalize_answer(r["golden_answers"][0]) in ("yes", "no")]
    env_kwargs = {**SEARCH_R1_SMOLLM2_ENV_KWARGS, "retriever": bm25}
    assert answerable(extra, env_kwargs=env_kwargs) == extra


def test_the_recipe_and_the_benchmarks_play_the_same_env() -> None:
    recipe = tomllib.loads(RECIPE.read_text())
    assert recipe["env"]["kwargs"] == SEARCH_R1_SMOLLM2_ENV_KWARGS
    assert recipe["data"]["path"] == "data/search/multihop_split.jsonl.gz"
    assert recipe["eval"]["num_tasks"] == 100
    assert get_benchmark("multihop_heldout").max_new_tokens == recipe["rollout"]["max_new_tokens"]
    held_out = [row["id"] for _, row, _ in load_tasks(get_benchmark("multihop_heldout"))]
    closed = [row["id"] for _, row, _ in load_tasks(get_benchmark("multihop_closed_book"))]
    assert held_out == closed == [r["id"] for r in split_held_out(load_data_rows(SPLIT), 100)[1]]
    assert "<search>" not in CLOSED_BOOK_ENV_KWARGS["prompt_template"]


def test_demonstrations_copy_the_answer_out_of_what_was_retrieved(bm25) -> None:
    env_kwargs = {**SEARCH_R1_SMOLLM2_ENV_KWARGS, "retriever": bm25}
    transcripts = demonstrations(64, seed=3, questions=str(SPLIT), env_kwargs=env_kwargs)
    assert len(transcripts) == 64
    held_out = {r["question"] for r in iter_jsonl(SPLIT) if r["split"] == "heldout"}
    env = SearchR1Env(**env_kwargs)
    second_hops = 0
    for messages in transcripts:
        question = messages[0]["content"].rsplit("Question: ", 1)[1].strip()
        assert question not in held_out
        searches = [m["content"] for m in messages if m["role"] == "assistant"][:-1]
        assert searches and all(s.startswith("<search> ") for s in searches)
        second_hops += len(searches) == 2
        answer = messages[-1]["content"].removeprefix("<answer> ").removesuffix(" </answer>")
        information = [m["content"] for m in messages if m["content"].startswith("<information>")]
        assert answer_in_texts(answer, information[-1:]) or answer_in_texts(answer, information)
        # replaying the transcript through the env scores it: exact match, answer retrieved
        env.reset(options={"task": {"question": question, "golden_answers": [answer]}})
        for action in [m["content"] for m in messages if m["role"] == "assistant"]:
            *_, info = env.step(action)
        assert info["em"] == 1.0 and info["answer_in_retrieved"] == 1.0
    assert second_hops > 0  # the gold paragraph's title is searched when the question missed
    env.close()


def test_answer_in_retrieved_is_whole_words_after_normalisation() -> None:
    texts = ["Doc 1(Title: \"Leach\") Sir Edmund Leach was a British anthropologist."]
    assert answer_in_texts("british", texts)
    assert answer_in_texts("The British.", texts)  # articles and punctuation are normalised away
    assert not answer_in_texts("Brit", texts)  # a part of a word is not the answer
    assert not answer_in_texts("", texts) and not answer_in_texts(None, texts)
    metrics = qa_metrics("British", ["British"], texts)
    assert metrics["answer_in_retrieved"] == 1.0 and metrics["gold"] == ["British"]
    assert "answer_in_retrieved" not in qa_metrics("British", ["British"])
    assert normalize_answer("The  British.") == "british"


def test_a_closed_book_episode_never_searches(bm25) -> None:
    env = SearchR1Env(**{**CLOSED_BOOK_ENV_KWARGS, "retriever": bm25})
    env.reset(options={"task": {"question": "Who wrote Hamlet?", "golden_answers": ["Shakespeare"]}})
    _, reward, terminated, truncated, info = env.step("<search> Hamlet </search>")
    assert reward == 0.0 and info["searches"] == 0 and (terminated or truncated)


def test_rl_trains_on_the_training_questions_a_search_answers(bm25) -> None:
    recipe = tomllib.loads(RECIPE.read_text())
    assert recipe["data"]["train_filter"] == (
        "palaestra.envs.search.multihop_demonstrations:answerable")
    train, held_out = split_held_out(load_data_rows(SPLIT), 100)
    env_kwargs = {**SEARCH_R1_SMOLLM2_ENV_KWARGS, "retriever": bm25}
    kept = answerable(train, env_kwargs=env_kwargs)
    assert 100 < len(kept) < len(train)
    assert not {r["id"] for r in kept} & {r["id"] for r in held_out}
    assert [r["id"] for r in kept] == [r["id"] for r in train if r in kept]  # in order
    # every kept question has demonstrations, and each demonstration's question is kept
    questions = {question_of(r).strip() for r in kept}
    for messages in demonstrations(32, seed=1, questions=str(SPLIT), env_kwargs=env_kwargs):
        assert messages[0]["content"].rsplit("Question: ", 1)[1].strip() in questions

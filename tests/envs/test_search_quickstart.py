"""The search quickstart's data, demonstrations and benchmark (configs/search_r1_quickstart.toml).

The shipped files are what the generator script writes; held-out questions ask about people no
training question mentions, and their answers appear only in those people's passages; the
demonstrations mix right searches with wrong answers from memory and never touch a held-out
question; the ``search_r1_quickstart`` benchmark plays exactly the run's held-out rows with the
run's env kwargs.
"""

from __future__ import annotations

import importlib.util
import json
import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data" / "search_quickstart"
CONFIG = REPO / "configs" / "search_r1_quickstart.toml"


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def config() -> dict:
    return tomllib.loads(CONFIG.read_text())


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(REPO)  # the quickstart's paths are relative to the repository root


def test_the_shipped_files_are_what_the_script_writes():
    spec = importlib.util.spec_from_file_location(
        "make_search_quickstart_data", REPO / "scripts" / "make_search_quickstart_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    corpus, questions = module.build(500, 100, 150, 0)
    assert corpus == _rows("corpus.jsonl")
    assert questions == _rows("questions.jsonl")
    assert sum(p.stat().st_size for p in DATA.iterdir()) < 2_000_000


def test_held_out_answers_come_only_from_the_corpus(config):
    questions, corpus = _rows("questions.jsonl"), _rows("corpus.jsonl")
    held = [q for q in questions if q["split"] == "heldout"]
    assert len(held) == config["eval"]["num_tasks"] == 100
    assert questions[-len(held):] == held  # the tail that training holds out
    name = re.compile(r"^Where does (person \d+) live\?$")
    train_text = " ".join(q["question"] for q in questions if q["split"] == "train")
    docs = {d["id"]: d["contents"] for d in corpus}
    for q in held:
        person, answer = name.match(q["question"]).group(1), q["golden_answers"][0]
        assert person not in train_text  # never asked about in training
        assert answer not in q["question"]  # not guessable from the question
        holders = [i for i, text in docs.items() if re.search(rf"\b{answer}\.", text)]
        assert q["gold_ids"][0] in holders and f"{person} lives in {answer}." in docs[q["gold_ids"][0]]
    # places are shared by many people: a name says nothing about its place
    places = [q["golden_answers"][0] for q in questions]
    assert len(set(places)) > 140 and max(places.count(p) for p in set(places)) < 15


def test_demonstrations_mix_right_searches_and_wrong_guesses(config):
    from palaestra.envs.search.demonstrations import demonstrations, subject_of
    from palaestra.envs.search.env import SearchR1Env

    env_kwargs = config["env"]["kwargs"]
    questions = config["warmup"]["kwargs"]["questions"]
    dialogues = demonstrations(200, seed=3, questions=questions, search_fraction=0.5,
                               env_kwargs=env_kwargs)
    assert dialogues == demonstrations(200, seed=3, questions=questions, search_fraction=0.5,
                                       env_kwargs=env_kwargs)
    held_out = {q["question"] for q in _rows("questions.jsonl") if q["split"] == "heldout"}
    searched = right = 0
    for messages in dialogues:
        prompt = messages[0]["content"]
        question = prompt.rsplit("Question: ", 1)[1].strip()
        assert question not in held_out
        env = SearchR1Env(**env_kwargs)
        env.reset(options={"task": {"question": question, "golden_answers": ["?"]}})
        assert [m["role"] for m in messages[1::2]] == ["assistant"] * len(messages[1::2])
        if len(messages) == 4:  # search, information, answer
            searched += 1
            assert messages[1]["content"] == f"<search> {subject_of(question)} </search>"
            info = messages[2]["content"]
            answer = re.search(r"<answer> (.+) </answer>", messages[3]["content"]).group(1)
            assert info.startswith("<information>Doc 1(Title: ") and f"lives in {answer}." in info
            right += 1
        else:
            assert len(messages) == 2 and messages[1]["content"].startswith("<answer> ")
        env.close()
    assert 70 <= searched <= 130 and right == searched


def test_the_benchmark_plays_the_runs_held_out_rows_with_its_env_kwargs(config):
    from palaestra.benchmarks.registry import get_benchmark, load_tasks
    from palaestra.rollout.data import load_rows, split_held_out

    bench = get_benchmark("search_r1_quickstart")
    assert dict(bench.env_kwargs) == config["env"]["kwargs"]
    assert bench.env_id == config["env"]["id"]
    tasks = [row for _, row, _ in load_tasks(bench)]
    held = split_held_out(load_rows(config["data"]["path"]), config["eval"]["num_tasks"])[1]
    assert tasks == held


def test_a_scripted_searcher_is_right_and_a_guesser_is_not(config):
    """The task is solvable by searching and copying, and not by answering from memory."""
    from palaestra.envs.search.demonstrations import subject_of
    from palaestra.envs.search.env import SearchR1Env

    env = SearchR1Env(**config["env"]["kwargs"])
    held = [q for q in _rows("questions.jsonl") if q["split"] == "heldout"]
    train = [q["golden_answers"][0] for q in _rows("questions.jsonl") if q["split"] == "train"]
    common = max(set(train), key=train.count)
    searched = guessed = 0.0
    for q in held:
        env.reset(options={"task": q})
        obs, *_ = env.step(f"<search> {subject_of(q['question'])} </search>")
        place = re.search(r"lives in (town \d+)\.", obs[0].content).group(1)
        searched += env.step(f"<answer> {place} </answer>")[1]
        env.reset(options={"task": q})
        guessed += env.step(f"<answer> {common} </answer>")[1]  # the commonest training answer
    env.close()
    assert searched == len(held) and guessed <= 3

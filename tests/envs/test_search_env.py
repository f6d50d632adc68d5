"""Search-R1 envs over the shipped corpus: BM25 recall, the tag protocol, rewards, the tool variant."""

import json

import pytest

from palaestra.envs import make
from palaestra.envs.search import BM25Retriever, SearchR1Env, SearchR1ToolsEnv, shared_bm25
from palaestra.envs.search.corpus import Document, Hit, format_hits, load_corpus
from palaestra.envs.search.env import INVALID_ACTION_MESSAGE, SEARCH_R1_PROMPT
from palaestra.envs.search.evaluate import retrieval_recall
from palaestra.envs.shipped import load_rows
from palaestra.errors import ConfigError
from palaestra.types import Message, ToolCall


@pytest.fixture(scope="module")
def bm25():
    retriever = shared_bm25()  # one index per process, cached on disk under ~/.cache/palaestra
    retriever.search(["warm up"], 1)
    return retriever


@pytest.fixture(scope="module")
def multihop():
    return load_rows("multihop", {"multihop": "search/multihop.jsonl.gz"})


def test_shipped_corpus_and_questions_are_consistent(bm25, multihop):
    docs = bm25.documents
    assert len(docs) == 10_991 and len({d.id for d in docs}) == len(docs)
    assert all(d.contents.startswith('"') and "\n" in d.contents for d in docs[:50])
    assert len(multihop) == 300
    ids = {d.id for d in docs}
    for row in multihop:
        assert row["golden_answers"] and row["gold_ids"] and set(row["gold_ids"]) <= ids


def test_bm25_recall_at_3_on_the_multihop_questions(bm25, multihop):
    metrics = retrieval_recall(bm25, multihop, k=3)
    print("BM25 on the shipped multi-hop questions:", metrics)
    # "most" questions get a gold paragraph in the top 3 (measured: hit@3 0.907, recall@3 0.573)
    assert metrics["n"] == 300
    assert metrics["hit@3"] > 0.85
    assert metrics["recall@3"] > 0.5


def test_bm25_index_is_built_once_then_loaded_from_the_cache(tmp_path):
    corpus = tmp_path / "tiny.jsonl"
    rows = [
        {"id": "a", "contents": '"Apple"\nThe apple is a fruit that grows on trees.'},
        {"id": "b", "contents": '"Banana"\nBananas are long yellow fruit.'},
        {"id": "c", "contents": '"Carrot"\nA carrot is an orange root vegetable.'},
    ]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = BM25Retriever(corpus, cache_dir=tmp_path / "cache")
    hits = first.search(["orange root vegetable", "yellow"], topk=5)
    assert first.built_index
    # only documents sharing a term with the query come back (topk is an upper bound)
    assert [h.document.id for h in hits[0]] == ["c"] and hits[0][0].score > 0
    assert [h.document.id for h in hits[1]] == ["b"]
    assert first.search(["the of and"], topk=5) == [[]]  # stop words only: no documents
    second = BM25Retriever(corpus, cache_dir=tmp_path / "cache")
    assert second.search(["orange root vegetable"], 1)[0][0].document.id == "c"
    assert not second.built_index
    # a changed corpus gets a new index
    corpus.write_text(json.dumps({"id": "z", "contents": '"Zebra"\nStriped horse.'}) + "\n")
    third = BM25Retriever(corpus, cache_dir=tmp_path / "cache")
    assert third.search(["striped"], 3)[0][0].document.id == "z" and third.built_index


def test_format_hits_is_search_r1s_rendering():
    hits = [Hit(Document("1", '"Paris"\nParis is the capital.'), 3.0), Hit(Document("2", '"X"'), 1.0)]
    assert format_hits(hits) == 'Doc 1(Title: "Paris") Paris is the capital.\nDoc 2(Title: "X") \n'
    assert Document.from_dict({"title": "T", "text": "body"}).contents == '"T"\nbody'
    assert format_hits(hits, passage_words=2) == (
        'Doc 1(Title: "Paris") Paris is ...\nDoc 2(Title: "X") \n')
    assert format_hits(hits, passage_words=4) == format_hits(hits)  # short passages stay whole
    with pytest.raises(ConfigError, match="passage_words"):
        SearchR1Env(passage_words=0)
    with pytest.raises(ConfigError, match="contents"):
        Document.from_dict({"id": "1"})


def test_corpus_errors_are_explained(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_corpus(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "contents": "x"}\nnot json\n')
    with pytest.raises(ConfigError, match="bad.jsonl:2"):
        load_corpus(bad)


def _gold_task(multihop, index=0):
    return dict(multihop[index])


def test_search_then_answer_gets_reward_one(bm25, multihop):
    env = SearchR1Env(retriever=bm25)
    task = _gold_task(multihop, 5)
    obs, info = env.reset(options={"task": task})
    assert len(obs) == 1 and obs[0].role == "user"
    assert obs[0].content == SEARCH_R1_PROMPT.format(question=task["question"].strip())
    obs, reward, terminated, truncated, info = env.step(
        f"<think>I need facts.</think><search>{task['question']}</search>"
    )
    assert reward == 0.0 and not terminated and not truncated
    text = obs[0].content
    assert obs[0].role == "user" and text.startswith("<information>Doc 1(Title: ")
    assert text.endswith("</information>") and text.count("\nDoc ") == 2  # top-3
    assert info["searches"] == 1
    answer = task["golden_answers"][0]
    obs, reward, terminated, truncated, info = env.step(
        f"<think>Found it.</think>\n<answer> {answer.upper()}. </answer>"
    )
    assert obs == () and reward == 1.0 and terminated and not truncated
    assert info["em"] == 1.0 and info["f1"] == 1.0 and info["searches"] == 1
    assert info["gold"] == task["golden_answers"]  # an eval record shows the right answer


def test_the_first_action_tag_decides_and_the_last_answer_is_scored(bm25, multihop):
    env = SearchR1Env(retriever=bm25)
    task = _gold_task(multihop, 1)
    env.reset(options={"task": task})
    # a search first: the answer hallucinated after it is ignored (Search-R1 stops at </search>)
    obs, reward, terminated, *_ = env.step(
        f"<search>{task['question']}</search><information>fake</information><answer>{task['golden_answers'][0]}</answer>"
    )
    assert not terminated and reward == 0.0 and obs[0].content.startswith("<information>Doc 1")
    _, reward, terminated, _, info = env.step(
        f"<answer>wrong</answer> on second thought <answer>{task['golden_answers'][0]}</answer>"
    )
    assert terminated and reward == 1.0 and info["answer"] == task["golden_answers"][0]


def test_invalid_actions_wrong_answers_and_the_format_reward(bm25, multihop):
    task = _gold_task(multihop, 2)
    env = SearchR1Env(retriever=bm25, format_reward=0.2)
    env.reset(options={"task": task})
    obs, reward, terminated, _, info = env.step("I will just think out loud.")
    assert obs[0].content == INVALID_ACTION_MESSAGE and reward == 0.0 and not terminated
    obs, *_ = env.step("<search>   </search>")  # an empty query is not a search
    assert obs[0].content == INVALID_ACTION_MESSAGE
    _, reward, terminated, _, info = env.step("<answer>certainly not this</answer>")
    assert terminated and reward == 0.2 and info["em"] == 0.0 and info["invalid_actions"] == 2
    env = SearchR1Env(retriever=bm25)  # format_reward defaults to 0, as in Search-R1
    env.reset(options={"task": task})
    assert env.step("<answer>certainly not this</answer>")[1] == 0.0


def test_the_f1_reward_gives_partial_credit_that_no_padding_games(bm25):
    """``reward="f1"``: a wrong answer earns its token F1, never 1.0; padding the answer with
    every candidate, or the question's own words, earns less than the right name alone."""
    task = {"question": "Which network was founded by Betty Cohen?",
            "golden_answers": ["Cartoon Network"]}

    def score(answer: str, **kwargs):
        env = SearchR1Env(retriever=bm25, reward="f1", **kwargs)
        env.reset(options={"task": task})
        _, reward, terminated, _, info = env.step(f"<answer>{answer}</answer>")
        assert terminated
        return reward, info["em"]

    assert score("cartoon network.") == (1.0, 1.0)
    assert score("Network") == (pytest.approx(2 / 3), 0.0)  # half the gold: partial credit
    padded, em = score("Cartoon Network, HBO, CNN, Nickelodeon, Disney Channel, Fox")
    assert em == 0.0 and padded < 0.5 < score("Network")[0]
    assert score("Which network was founded by Betty Cohen")[0] < 0.5
    assert score("ABC") == (0.0, 0.0)
    assert score("ABC", format_reward=0.1)[0] == 0.1  # the floor for a given answer stays
    env = SearchR1Env(retriever=bm25, reward="f1")  # no answer: nothing
    env.reset(options={"task": task})
    assert env.step("<search>x</search>")[1] == 0.0
    with pytest.raises(ConfigError, match="'em'"):
        SearchR1Env(retriever=bm25, reward="recall")


def test_out_of_turns_without_an_answer(bm25, multihop):
    env = SearchR1Env(retriever=bm25, max_turns=2)
    env.reset(options={"task": _gold_task(multihop)})
    _, _, terminated, truncated, _ = env.step("<search>first</search>")
    assert not terminated and not truncated
    obs, reward, terminated, truncated, info = env.step("<search>second</search>")
    assert obs == () and reward == 0.0 and truncated and not terminated  # no search on the last turn
    assert info["stop_reason"] == "truncated" and info["em"] == 0.0 and info["searches"] == 1


def test_nq_open_rows_and_custom_datasets(bm25, tmp_path):
    env = make("palaestra/SearchR1-v0", dataset="nq_open", retriever=bm25)
    obs, _ = env.reset(seed=0)
    assert len(env.dataset) == 3610 and isinstance(env.task["answer"], list)
    assert obs[0].content.rstrip().endswith("?")  # Search-R1 appends the question mark
    _, reward, *_ = env.step(f"<answer>{env.task['answer'][-1]}</answer>")
    assert reward == 1.0
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"question": "Who?", "golden_answers": ["Me"]}) + "\n")
    env = SearchR1Env(dataset=str(path), retriever=bm25)
    env.reset(seed=1)
    assert env.step("<answer>me</answer>")[1] == 1.0
    with pytest.raises(ConfigError, match="gold answers"):
        env.reset(options={"task": {"question": "no answers"}})
    with pytest.raises(ConfigError, match="unknown dataset"):
        SearchR1Env(dataset="no-such-set").reset(seed=0)
    with pytest.raises(ConfigError, match="unknown retriever"):
        SearchR1Env(retriever="elasticsearch")


def test_same_seed_same_episode_and_fork_branches_independently(bm25):
    env = SearchR1Env(retriever=bm25)
    first, _ = env.reset(seed=7)
    again, _ = env.reset(seed=7)
    assert first == again
    env.step("<search>capital city</search>")
    branch = env.fork()
    assert branch.retriever is env.retriever  # shared resources are not copied
    *_, done_a, _, _ = branch.step("<answer>wrong</answer>")
    *_, done_b, _, _ = env.step("<search>another query</search>")
    assert done_a and not done_b and branch.searches == 1 and env.searches == 2
    state = env.snapshot()
    assert len(state) < 50_000  # the dataset and the index are not in the snapshot
    env.step(f"<answer>{env.task['golden_answers'][0]}</answer>")
    env.restore(state)
    assert not env.done and env.turn == 2


async def test_async_steps_use_the_async_retriever(bm25, multihop):
    env = SearchR1Env(retriever=bm25)
    task = _gold_task(multihop, 3)
    await env.areset(options={"task": task})
    obs, *_ = await env.astep(f"<search>{task['question']}</search>")
    assert obs[0].content.startswith("<information>")
    _, reward, terminated, *_ = await env.astep(f"<answer>{task['golden_answers'][0]}</answer>")
    assert reward == 1.0 and terminated


def test_tool_variant_searches_with_a_function_tool(bm25, multihop):
    env = make("palaestra/SearchR1Tools-v0", retriever=bm25)
    task = _gold_task(multihop, 4)
    obs, info = env.reset(options={"task": task})
    assert [m.role for m in obs] == ["system", "user"]
    assert [t["function"]["name"] for t in info["tools"]] == ["search"]
    call = ToolCall("search", json.dumps({"query": task["question"]}), id="call-1")
    obs, reward, terminated, *_ = env.step(Message("assistant", "", tool_calls=(call,)))
    assert obs[0].role == "tool" and obs[0].tool_call_id == "call-1"
    assert obs[0].content.startswith("Doc 1(Title: ") and not terminated
    bad = ToolCall("search", '{"q": 1}', id="call-2")
    obs, *_ = env.step(Message("assistant", "", tool_calls=(bad,)))
    assert obs[0].content.startswith("Error: invalid arguments")
    _, reward, terminated, _, info = env.step(f"<answer>{task['golden_answers'][0]}</answer>")
    assert reward == 1.0 and terminated and info["f1"] == 1.0
    assert info["gold"] == task["golden_answers"]
    env.reset(options={"task": task})
    _, reward, *_ = env.step(task["golden_answers"][0])  # a bare answer, without tags, also counts
    assert reward == 1.0
    env.reset(options={"task": task})
    assert env.step("I do not know")[1] == 0.0
    assert isinstance(SearchR1ToolsEnv(retriever=bm25).tool_schemas()[0]["function"]["parameters"], dict)

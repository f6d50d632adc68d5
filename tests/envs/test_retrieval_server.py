"""The Search-R1 retrieval server and the HTTP client over real loopback sockets, and the server
tried as a careless client would: queries that match nothing get no documents, booleans are
strict, every problem of a request is reported at once."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from aiohttp import web

from palaestra.envs.search import HTTPRetriever, RetrievalError, SearchR1Env, shared_bm25
from palaestra.envs.search.http import parse_response, retrieve_url
from palaestra.envs.search.serve import serve_in_background
from palaestra.errors import ConfigError


@pytest.fixture(scope="module")
def bm25():
    retriever = shared_bm25()
    retriever.search(["warm up"], 1)
    return retriever


@pytest.fixture
async def server(bm25):
    runner, url = await serve_in_background(bm25, default_topk=2)
    yield url
    await runner.cleanup()


async def _post(url, body):
    import aiohttp

    data = body if isinstance(body, str) else json.dumps(body)
    async with aiohttp.ClientSession() as session, session.post(url, data=data) as r:
        return r.status, await r.json(content_type=None)


async def test_server_speaks_the_search_r1_api(server, bm25):
    status, payload = await _post(
        server, {"queries": ["Shirley Temple actress", "Ed Wood film"], "topk": 3, "return_scores": True}
    )
    assert status == 200 and len(payload["result"]) == 2
    first = payload["result"][0]
    assert len(first) == 3 and set(first[0]) == {"document", "score"}
    assert set(first[0]["document"]) == {"id", "contents"}
    assert first[0]["score"] >= first[1]["score"] >= first[2]["score"]
    local = bm25.search(["Shirley Temple actress"], 3)[0]
    assert [d["document"]["id"] for d in first] == [h.document.id for h in local]
    # without scores: bare documents; without topk: the server's default (2 here)
    status, payload = await _post(server, {"queries": ["Ed Wood"]})
    assert status == 200 and len(payload["result"][0]) == 2
    assert set(payload["result"][0][0]) == {"id", "contents"}


@pytest.mark.parametrize(
    "body,message",
    [
        ("not json", "must be JSON"),
        ([1, 2], "JSON object"),
        ({"queries": "one string"}, "list of strings"),
        ({"queries": [1]}, "list of strings"),
        ({"queries": ["x"], "topk": 0}, "topk"),
        ({"queries": ["x"], "topk": "3"}, "topk"),
    ],
)
async def test_server_rejects_bad_requests_with_a_reason(server, body, message):
    status, payload = await _post(server, body)
    assert status == 400 and message in payload["error"]


async def test_client_round_trip_and_env_over_http(server, bm25):
    client = HTTPRetriever(server, timeout_s=10)
    hits = await client.asearch(["Meet Corliss Archer", "Lilu mythology"], 3)
    local = bm25.search(["Meet Corliss Archer", "Lilu mythology"], 3)
    assert [[h.document for h in row] for row in hits] == [[h.document for h in row] for row in local]
    assert hits[0][0].score == pytest.approx(local[0][0].score, rel=1e-5)
    assert await client.asearch([], 3) == []
    env = SearchR1Env(retriever=server)
    env.reset(seed=0)
    obs, *_ = await env.astep("<search>Meet Corliss Archer</search>")
    assert obs[0].content.startswith('<information>Doc 1(Title: "Meet Corliss Archer')
    _, reward, terminated, *_ = await env.astep(f"<answer>{env.task['golden_answers'][0]}</answer>")
    assert reward == 1.0 and terminated


async def test_client_retries_transient_errors_then_succeeds():
    calls = {"n": 0}

    async def flaky(request):
        calls["n"] += 1
        if calls["n"] <= 2:
            return web.Response(status=503, text="warming up")
        body = await request.json()
        doc = {"id": "7", "contents": '"T"\nbody'}
        return web.json_response({"result": [[{"document": doc, "score": 1.5}] for _ in body["queries"]]})

    app = web.Application()
    app.router.add_post("/retrieve", flaky)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        client = HTTPRetriever(f"http://127.0.0.1:{port}", retries=3, backoff_s=0.01)
        hits = await client.asearch(["q"], 1)
        assert calls["n"] == 3 and hits[0][0].document.id == "7" and hits[0][0].score == 1.5
        calls["n"] = -100  # keeps failing: the error names the server and the last failure
        client = HTTPRetriever(f"http://127.0.0.1:{port}/retrieve", retries=1, backoff_s=0.01)
        with pytest.raises(RetrievalError, match="failed 2 times.*HTTP 503"):
            await client.asearch(["q"], 1)
    finally:
        await runner.cleanup()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_unreachable_server_and_bad_payloads():
    client = HTTPRetriever(f"http://127.0.0.1:{_free_port()}", retries=1, backoff_s=0.01, timeout_s=2)
    with pytest.raises(RetrievalError, match="Is it running"):
        await client.asearch(["q"], 1)
    with pytest.raises(RetrievalError, match="'result' list"):
        parse_response({"docs": []}, 1)
    with pytest.raises(RetrievalError, match="asked 2 queries"):
        parse_response({"result": [[]]}, 2)
    hits = parse_response({"result": [[{"title": "T", "text": "x", "contents": '"T"\nx'}]]}, 1)
    assert hits[0][0].document.title == '"T"'  # Lucene-style bare documents are accepted
    assert retrieve_url("http://h:1") == "http://h:1/retrieve"
    assert retrieve_url("http://h:1/api/search") == "http://h:1/api/search"
    with pytest.raises(ConfigError):
        retrieve_url("h:1")


def test_sync_client_from_plain_code(server_thread_url):
    hits = HTTPRetriever(server_thread_url).search(["Ed Wood"], 2)
    assert len(hits) == 1 and len(hits[0]) == 2


@pytest.fixture
def server_thread_url(bm25):
    """A server on its own loop in a thread, for the blocking client."""
    import threading

    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder = {}

    def run():
        asyncio.set_event_loop(loop)
        holder["runner"], holder["url"] = loop.run_until_complete(serve_in_background(bm25))
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(30)
    yield holder["url"]
    asyncio.run_coroutine_threadsafe(holder["runner"].cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_serve_retriever_command_answers_over_loopback(bm25):
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "palaestra", "serve-retriever", "--port", str(port), "--topk", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    assert json.load(r)["status"] == "ok"
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "the server did not start within 60 s"
                time.sleep(0.2)
        hits = HTTPRetriever(url).search(["Ed Wood film director"], 2)
        assert [h.document.id for h in hits[0]] == [
            h.document.id for h in bm25.search(["Ed Wood film director"], 2)[0]
        ]
    finally:
        proc.terminate()
        proc.wait(10)
    assert "serving 10991 documents" in proc.stdout.read()


# ---------------------------------------------------------------- adversarial requests
@pytest.mark.parametrize("query", ["", "   ", "the of and a is", "zzqqxxvvkk", "!!! ???"])
async def test_a_query_that_matches_nothing_gets_no_documents(server, query):
    status, payload = await _post(
        server, {"queries": [query, "Ed Wood"], "topk": 3, "return_scores": True})
    assert status == 200 and payload["result"][0] == []
    assert len(payload["result"][1]) == 3 and all(h["score"] > 0 for h in payload["result"][1])


def _unique_word(documents) -> tuple[str, str]:
    """A word (bm25s' token pattern) that occurs in exactly one document, and that document."""
    import re
    from collections import Counter

    pattern = re.compile(r"(?u)\b\w\w+\b")
    seen: Counter[str] = Counter()
    where: dict[str, str] = {}
    for doc in documents:
        for word in set(pattern.findall(doc.contents.lower())):
            seen[word] += 1
            where[word] = doc.id
    word = min(w for w, n in seen.items() if n == 1 and w.isalpha() and len(w) >= 6)
    return word, where[word]


async def test_a_rare_word_gets_only_the_documents_that_contain_it(server, bm25):
    word, doc_id = _unique_word(bm25.documents)
    status, payload = await _post(server, {"queries": [word], "topk": 5, "return_scores": True})
    assert status == 200 and [h["document"]["id"] for h in payload["result"][0]] == [doc_id]
    assert bm25.search([word], 5)[0][0].document.id == doc_id


@pytest.mark.parametrize("value", ["no", "false", 0, 1, None, [True]])
async def test_return_scores_must_be_a_boolean(server, value):
    status, payload = await _post(server, {"queries": ["Ed Wood"], "return_scores": value})
    assert status == 400 and "'return_scores' must be true or false" in payload["error"]


async def test_every_problem_of_a_request_is_reported(server):
    status, payload = await _post(
        server, {"queries": ["ok", 7], "topk": True, "return_scores": "no", "top_k": 3})
    assert status == 400 and len(payload["problems"]) == 4, payload
    assert any("unknown field(s) ['top_k']" in p for p in payload["problems"])
    assert any("queries[1] is 7" in p for p in payload["problems"])
    status, payload = await _post(server, {"topk": 3})
    assert status == 400 and "'queries' is required" in payload["error"]


async def test_no_queries_is_an_empty_result(server):
    assert await _post(server, {"queries": []}) == (200, {"result": []})


def test_serve_retriever_refuses_a_topk_out_of_range():
    out = subprocess.run([sys.executable, "-m", "palaestra", "serve-retriever", "--topk", "0",
                          "--port", str(_free_port())], check=False, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode != 0 and "--topk must be in [1, 100]" in out.stdout + out.stderr

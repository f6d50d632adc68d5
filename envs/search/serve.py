"""``palaestra serve-retriever``: serve a BM25 index with the Search-R1 retrieval API.

    palaestra serve-retriever --port 8000                       # the shipped 11k-passage corpus
    palaestra serve-retriever --corpus wiki.jsonl --topk 3      # your {"id","contents"} JSONL

Endpoints: ``POST /retrieve`` with ``{"queries": [str], "topk": int|null, "return_scores": bool}``
answers ``{"result": [[{"document": {"id", "contents"}, "score"}]]}`` (bare documents when
``return_scores`` is false), as Search-R1's ``retrieval_server.py`` does; ``GET /health``.
A query that matches no document (empty, only stop words, unknown words) gets an empty list.
Requests are checked strictly and every problem is reported at once in a 400
``{"error": "...", "problems": [...]}``: ``queries`` a list of strings, ``topk`` an integer in
``[1, 100]`` or null, ``return_scores`` ``true`` or ``false`` (``"no"`` is not false), no other
fields. Point an env at it with ``retriever="http://HOST:PORT/retrieve"``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from palaestra.envs.search.retriever import Retriever

MAX_QUERIES = 1024
MAX_TOPK = 100


REQUEST_FIELDS = ("queries", "topk", "return_scores")


def _error(status: int, message: str, problems: list[str] | None = None) -> Any:
    from aiohttp import web

    body: dict[str, Any] = {"error": message}
    if problems:
        body["problems"] = problems
    return web.json_response(body, status=status)


def _type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "an object", type(None): "null"}
    return f"{value!r:.40} ({names.get(type(value), type(value).__name__)})"


def check_request(body: object, default_topk: int) -> tuple[list[str], int, bool, list[str]]:
    """``(queries, topk, return_scores, problems)`` of a ``/retrieve`` body; no coercion."""
    if not isinstance(body, dict):
        usage = '{"queries": [...], "topk": 3, "return_scores": true}'
        return [], default_topk, False, [f"the body must be a JSON object: {usage}"]
    problems = []
    extra = sorted(str(k) for k in body if k not in REQUEST_FIELDS)
    if extra:
        problems.append(f"unknown field(s) {extra}; the fields are {list(REQUEST_FIELDS)}")
    queries: Any = body.get("queries")  # a list of strings once no problem is found
    if "queries" not in body:
        problems.append("'queries' is required: a list of strings")
    elif not isinstance(queries, list):
        problems.append(f"'queries' must be a list of strings, got {_type(queries)}")
    else:
        bad = [i for i, q in enumerate(queries) if not isinstance(q, str)]
        if bad:
            problems.append(f"'queries' must be a list of strings: queries[{bad[0]}] is "
                            f"{_type(queries[bad[0]])}")
        if len(queries) > MAX_QUERIES:
            problems.append(f"at most {MAX_QUERIES} queries per request, got {len(queries)}")
    topk = body.get("topk")
    topk = default_topk if topk is None else topk
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= MAX_TOPK:
        problems.append(f"'topk' must be an integer in [1, {MAX_TOPK}] or null, got {_type(topk)}")
    scores = body.get("return_scores", False)
    if not isinstance(scores, bool):
        problems.append(f"'return_scores' must be true or false, got {_type(scores)}")
    return (queries if not problems else []), topk, scores is True, problems


def create_app(retriever: Retriever, default_topk: int = 3) -> Any:
    """The aiohttp application serving ``retriever`` (used by `run` and by the tests)."""
    from aiohttp import web

    async def retrieve(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body must be JSON: {\"queries\": [...], \"topk\": 3}")
        queries, topk, with_scores, problems = check_request(body, default_topk)
        if problems:
            return _error(400, "; ".join(problems), problems)
        hits = await retriever.asearch(queries, topk) if queries else []
        if with_scores:
            result: list[list[Any]] = [
                [{"document": h.document.to_dict(), "score": h.score} for h in row] for row in hits
            ]
        else:
            result = [[h.document.to_dict() for h in row] for row in hits]
        return web.json_response({"result": result})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application(client_max_size=8 * 1024 * 1024)
    app.router.add_post("/retrieve", retrieve)
    app.router.add_get("/health", health)
    return app


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", type=Path, default=None,
                        help="JSONL corpus of {\"id\", \"contents\"} rows (default: the shipped one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--topk", type=int, default=3, help="documents per query when the "
                        "request does not say (default 3)")
    parser.add_argument("--k1", type=float, default=1.5, help="BM25 k1 (default 1.5)")
    parser.add_argument("--b", type=float, default=0.75, help="BM25 b (default 0.75)")


def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    from palaestra.envs.search.bm25 import BM25Retriever
    from palaestra.errors import ConfigError

    if not 1 <= args.topk <= MAX_TOPK:
        raise ConfigError(f"--topk must be in [1, {MAX_TOPK}], got {args.topk}")
    retriever = BM25Retriever(args.corpus, k1=args.k1, b=args.b)
    print(f"indexing {retriever.corpus_path} (cached under {retriever.cache_dir}) ...", flush=True)
    retriever.search(["warm up"], 1)
    print(
        f"serving {len(retriever.documents)} documents on "
        f"http://{args.host}:{args.port}/retrieve (Ctrl-C stops)",
        flush=True,
    )
    web.run_app(create_app(retriever, args.topk), host=args.host, port=args.port, print=None)
    return 0


async def serve_in_background(
    retriever: Retriever, host: str = "127.0.0.1", port: int = 0, default_topk: int = 3
) -> tuple[Any, str]:
    """Start the server on the running loop; returns (runner, URL). ``await runner.cleanup()``."""
    from aiohttp import web

    runner = web.AppRunner(create_app(retriever, default_topk))
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    bound_port = runner.addresses[0][1]  # the real port when port=0 asked for a free one
    return runner, f"http://{host}:{bound_port}/retrieve"

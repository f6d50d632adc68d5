"""Client for a Search-R1-compatible retrieval server (``POST /retrieve``).

Request ``{"queries": [str], "topk": int, "return_scores": true}``; response
``{"result": [[{"document": {"id", "contents"}, "score": float}, ...] per query]}``. Bare document
items (``return_scores`` false) and Lucene-style ``{"title", "text"}`` documents are accepted too,
so the client talks to Search-R1's own server, FlashRAG's, and `palaestra serve-retriever`.

Connection errors, timeouts, HTTP 429 and 5xx are retried with exponential backoff; other HTTP
errors and malformed payloads fail at once with `RetrievalError`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

from palaestra.asyncio_utils import run_sync
from palaestra.envs.search.corpus import Document, Hit
from palaestra.envs.search.retriever import Retriever
from palaestra.errors import ConfigError, PalaestraError


class RetrievalError(PalaestraError, ConnectionError):
    """The retrieval server could not be reached or answered with an invalid payload."""


def retrieve_url(url: str) -> str:
    """``http://host:port`` -> ``http://host:port/retrieve``; a URL with a path is kept."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"the retriever URL must look like http://host:port/retrieve, got {url!r}")
    path = parts.path if parts.path not in ("", "/") else "/retrieve"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def parse_response(payload: object, n_queries: int) -> list[list[Hit]]:
    """Hits from a ``/retrieve`` response body; `RetrievalError` says what is malformed."""
    if not isinstance(payload, dict) or not isinstance(payload.get("result"), list):
        raise RetrievalError(
            f"the retrieval server answered without a 'result' list: {str(payload)[:200]}"
        )
    result = payload["result"]
    if len(result) != n_queries:
        raise RetrievalError(f"asked {n_queries} queries, the server answered {len(result)}")
    hits: list[list[Hit]] = []
    for per_query in result:
        if not isinstance(per_query, list):
            raise RetrievalError(f"each result must be a list, got {type(per_query).__name__}")
        row = []
        for item in per_query:
            if not isinstance(item, dict):
                raise RetrievalError(f"a retrieved item must be an object, got {item!r:.100}")
            doc = item.get("document", item)
            score = item.get("score", 0.0) if "document" in item else 0.0
            try:
                row.append(Hit(Document.from_dict(doc), float(score)))
            except (ConfigError, TypeError, ValueError) as exc:
                raise RetrievalError(f"malformed document from the server: {exc}") from None
        hits.append(row)
    return hits


class HTTPRetriever(Retriever):
    """Queries a remote ``/retrieve`` endpoint; each call opens its own aiohttp session."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.5,
    ) -> None:
        self.url = retrieve_url(url)
        if timeout_s <= 0 or retries < 0:
            raise ConfigError("timeout_s must be > 0 and retries >= 0")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s

    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        return run_sync(self.asearch(queries, topk))

    async def asearch(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        import aiohttp

        queries = [str(q) for q in queries]
        if not queries:
            return []
        body = {"queries": queries, "topk": int(topk), "return_scores": True}
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        last_error = ""
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for attempt in range(self.retries + 1):
                if attempt:
                    delay = self.backoff_s * 2 ** (attempt - 1)
                    await asyncio.sleep(delay * (0.5 + random.random()))
                try:
                    async with session.post(self.url, json=body) as response:
                        if response.status == 429 or response.status >= 500:
                            last_error = f"HTTP {response.status}: {(await response.text())[:200]}"
                            continue
                        if response.status != 200:
                            text = (await response.text())[:300]
                            raise RetrievalError(
                                f"the retrieval server at {self.url} refused the request "
                                f"(HTTP {response.status}): {text}"
                            )
                        payload = await response.json(content_type=None)
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                    last_error = f"{type(exc).__name__}: {exc}"
                    continue
                return parse_response(payload, len(queries))
        raise RetrievalError(
            f"the retrieval server at {self.url} failed {self.retries + 1} times (last: "
            f"{last_error}). Is it running? Start one with `palaestra serve-retriever`."
        )

    def __repr__(self) -> str:
        return f"HTTPRetriever({self.url!r})"

"""`make_retriever`: a config value turned into a retriever.

``"bm25"`` is the local BM25 index over the shipped corpus (or ``corpus=...``), shared by every env
of the process; an ``http(s)://`` URL is a Search-R1-compatible retrieval server.
"""

from __future__ import annotations

from pathlib import Path

from palaestra.envs.search.retriever import Retriever
from palaestra.errors import ConfigError


def make_retriever(
    spec: str | Retriever = "bm25",
    *,
    corpus: str | Path | None = None,
    timeout_s: float = 30.0,
    retries: int = 3,
) -> Retriever:
    """A retriever from ``"bm25"``, an ``http://host:port[/retrieve]`` URL, or an instance."""
    if isinstance(spec, Retriever):
        return spec
    if spec == "bm25":
        from palaestra.envs.search.bm25 import shared_bm25

        return shared_bm25(corpus)
    if isinstance(spec, str) and spec.startswith(("http://", "https://")):
        from palaestra.envs.search.http import HTTPRetriever

        return HTTPRetriever(spec, timeout_s=timeout_s, retries=retries)
    raise ConfigError(
        f"unknown retriever {spec!r}: use 'bm25' (local index over the corpus), the URL of a "
        "Search-R1 retrieval server (e.g. http://127.0.0.1:8000/retrieve, which "
        "`palaestra serve-retriever` provides), or a Retriever instance"
    )


__all__ = ["make_retriever"]

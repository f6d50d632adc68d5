"""Search-R1 environments, retrievers and the retrieval server.

- ``palaestra/SearchR1-v0`` (`SearchR1Env`): the Search-R1 protocol with ``<search>`` /
  ``<information>`` / ``<answer>`` tags; ``palaestra/SearchR1Tools-v0`` (`SearchR1ToolsEnv`): the
  same task with ``search`` as an OpenAI function tool, for chat models.
- Retrievers: `BM25Retriever` (local ``bm25s`` index over a ``{"id", "contents"}`` JSONL corpus,
  built on first use and cached on disk), `HTTPRetriever` (a Search-R1 ``POST /retrieve`` server),
  `make_retriever` ("bm25" or a URL).
- ``palaestra serve-retriever`` (`palaestra.envs.search.serve`) serves a BM25 index with the
  Search-R1 API.

Nothing heavy is imported here: ``bm25s`` and ``aiohttp`` load when an index is built or a request
is made.
"""

from palaestra.envs.search.bm25 import BM25Retriever, shared_bm25
from palaestra.envs.search.corpus import Document, Hit, format_hits, load_corpus
from palaestra.envs.search.env import SearchR1Env, SearchR1ToolsEnv
from palaestra.envs.search.http import HTTPRetriever, RetrievalError
from palaestra.envs.search.retriever import Retriever
from palaestra.envs.search.retrievers import make_retriever

__all__ = [
    "BM25Retriever",
    "Document",
    "HTTPRetriever",
    "Hit",
    "RetrievalError",
    "Retriever",
    "SearchR1Env",
    "SearchR1ToolsEnv",
    "format_hits",
    "load_corpus",
    "make_retriever",
    "shared_bm25",
]

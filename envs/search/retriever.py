"""The retriever interface (`Retriever`): queries in, ranked `Hit`s out.

Its implementations (`palaestra.envs.search.bm25`, `palaestra.envs.search.http`) import it;
`palaestra.envs.search.retrievers.make_retriever` picks one from a config value.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Sequence

from palaestra.envs.search.corpus import Hit


class Retriever(abc.ABC):
    """Answers a batch of queries with the ``topk`` best documents each."""

    @abc.abstractmethod
    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        """Blocking search; one hit list per query, best first, at most ``topk`` long (empty
        when nothing matches the query)."""

    async def asearch(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        """Async search (the default runs `search` in a worker thread)."""
        return await asyncio.to_thread(self.search, list(queries), topk)

    def close(self) -> None:
        """Release resources (idempotent)."""

"""Search corpora in the Search-R1/FlashRAG format and the Search-R1 rendering of results.

A corpus is JSON lines ``{"id": str, "contents": "\\"Title\\"\\ntext"}`` (optionally gzipped); the
shipped one (``data/search/corpus.jsonl.gz``, about 11k Wikipedia paragraphs) backs
``palaestra/SearchR1-v0`` by default. Results are shown to the model the way Search-R1 does:
``Doc 1(Title: "Title") text`` per line, the title being the first line of ``contents``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from palaestra.envs.shipped import iter_jsonl, shipped_path
from palaestra.errors import ConfigError

SHIPPED_CORPUS = "search/corpus.jsonl.gz"


@dataclass(frozen=True)
class Document:
    """One passage: its id and ``contents`` (title on the first line, then the text)."""

    id: str
    contents: str

    @property
    def title(self) -> str:
        return self.contents.split("\n", 1)[0]

    @property
    def text(self) -> str:
        return self.contents.split("\n", 1)[1] if "\n" in self.contents else ""

    def to_dict(self) -> dict[str, str]:
        return {"id": self.id, "contents": self.contents}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Document:
        """Accepts ``{"id", "contents"}`` and the ``{"title", "text"}`` rows of Lucene indexes."""
        contents = data.get("contents")
        if not isinstance(contents, str):
            if "title" not in data and "text" not in data:
                raise ConfigError(
                    f"a document needs 'contents' (or 'title' and 'text'), got keys {sorted(data)}"
                )
            contents = f'"{data.get("title", "")}"\n{data.get("text", "")}'
        return cls(id=str(data.get("id", "")), contents=contents)


@dataclass(frozen=True)
class Hit:
    """A retrieved document and its retrieval score."""

    document: Document
    score: float


def default_corpus_path() -> Path:
    return shipped_path(SHIPPED_CORPUS)


def load_corpus(path: str | Path | None = None) -> list[Document]:
    """Documents of a JSONL corpus (the shipped one when ``path`` is None)."""
    source = default_corpus_path() if path is None else Path(path)
    docs = [Document.from_dict(row) for row in iter_jsonl(source)]
    if not docs:
        raise ConfigError(f"the corpus {str(source)!r} holds no documents")
    return docs


def format_hits(hits: Sequence[Hit], passage_words: int | None = None) -> str:
    """Search-R1's rendering: ``Doc i(Title: <first line>) <rest>`` and a newline, per hit;
    with ``passage_words``, each passage's text is cut to its first that many words (a token
    budget for small models: the answer of a Wikipedia paragraph is most often near its start)."""
    return "".join(
        f"Doc {i}(Title: {h.document.title}) {_first_words(h.document.text, passage_words)}\n"
        for i, h in enumerate(hits, 1)
    )


def _first_words(text: str, words: int | None) -> str:
    if words is None:
        return text
    parts = text.split()
    return text if len(parts) <= words else " ".join(parts[:words]) + " ..."

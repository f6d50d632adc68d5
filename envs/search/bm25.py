"""Local BM25 retriever over a JSONL corpus (``bm25s``), built on first use and cached on disk.

A query gets at most ``topk`` documents, only those that share a term with it: an empty,
stop-word-only or out-of-vocabulary query gets none (an explicit empty result).

The index of a corpus is stored under ``$PALAESTRA_CACHE_DIR/bm25/<key>`` (default
``~/.cache/palaestra``), where the key hashes the corpus bytes, the BM25 parameters and the
``bm25s`` version, so a changed corpus is re-indexed and concurrent builders never see half an
index (it is written to a temporary folder and renamed). One retriever per corpus is shared by
all envs of a process (`shared_bm25`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from palaestra.envs.search.corpus import Document, Hit, default_corpus_path, load_corpus
from palaestra.envs.search.retriever import Retriever
from palaestra.errors import ConfigError, MissingExtraError


def cache_root() -> Path:
    """Where palaestra caches derived files (``$PALAESTRA_CACHE_DIR`` or ``~/.cache/palaestra``)."""
    env = os.environ.get("PALAESTRA_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "palaestra"


def _import_bm25s() -> Any:
    try:
        import bm25s
        import bm25s.tokenization
    except ImportError:
        raise MissingExtraError(
            "the BM25 retriever needs the 'bm25s' package: pip install bm25s (a core dependency "
            "of palaestra; reinstall palaestra if it is missing)"
        ) from None
    return bm25s


class BM25Retriever(Retriever):
    """BM25 (Lucene variant, ``k1``/``b``) over the documents of a JSONL corpus."""

    def __init__(
        self,
        corpus: str | Path | None = None,
        *,
        k1: float = 1.5,
        b: float = 0.75,
        cache_dir: str | Path | None = None,
    ) -> None:
        self.corpus_path = Path(corpus) if corpus is not None else default_corpus_path()
        if not self.corpus_path.exists():
            raise ConfigError(f"corpus file {str(self.corpus_path)!r} does not exist")
        self.k1, self.b = k1, b
        self.cache_dir = Path(cache_dir) if cache_dir is not None else cache_root() / "bm25"
        self._lock = threading.Lock()
        self._documents: list[Document] | None = None
        self._model: Any = None
        self._tokenizer: Any = None
        self.built_index = False  # True when this instance built (rather than loaded) the index

    def __getstate__(self) -> dict[str, Any]:
        # the index reloads from the disk cache on first use; locks do not pickle
        state = dict(self.__dict__)
        state.update(_lock=None, _documents=None, _model=None, _tokenizer=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # ----- index ----------------------------------------------------------------------------
    def _key(self) -> str:
        bm25s = _import_bm25s()
        digest = hashlib.sha256(self.corpus_path.read_bytes())
        digest.update(f"k1={self.k1};b={self.b};bm25s={bm25s.__version__};v1".encode())
        return digest.hexdigest()[:24]

    @property
    def index_dir(self) -> Path:
        return self.cache_dir / self._key()

    @property
    def documents(self) -> list[Document]:
        self._ensure_loaded()
        assert self._documents is not None
        return self._documents

    def _ensure_loaded(self) -> None:
        if self._model is not None:
            return
        with self._lock:
            if self._model is not None:
                return
            documents = load_corpus(self.corpus_path)
            index_dir = self.index_dir
            if not (index_dir / "palaestra.json").exists():
                self._build(documents, index_dir)
                self.built_index = True
            model, tokenizer = self._load(index_dir)
            if model.scores["num_docs"] != len(documents):
                raise ConfigError(
                    f"the cached BM25 index {index_dir} does not match the corpus "
                    f"({model.scores['num_docs']} vs {len(documents)} documents); delete it"
                )
            self._documents, self._tokenizer, self._model = documents, tokenizer, model

    def _build(self, documents: list[Document], index_dir: Path) -> None:
        bm25s = _import_bm25s()
        tokenizer = bm25s.tokenization.Tokenizer(stopwords="en", lower=True)
        tokenized = tokenizer.tokenize(
            [d.contents for d in documents], show_progress=False, return_as="tuple"
        )
        model = bm25s.BM25(k1=self.k1, b=self.b)
        model.index(tokenized, show_progress=False)
        index_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=index_dir.parent))
        try:
            model.save(str(tmp))
            tokenizer.save_vocab(str(tmp))
            tokenizer.save_stopwords(str(tmp))
            meta = {"corpus": str(self.corpus_path), "documents": len(documents),
                    "k1": self.k1, "b": self.b}
            (tmp / "palaestra.json").write_text(json.dumps(meta))
            try:
                tmp.rename(index_dir)
            except OSError:  # another process finished first; its index is identical
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @staticmethod
    def _load(index_dir: Path) -> tuple[Any, Any]:
        bm25s = _import_bm25s()
        model = bm25s.BM25.load(str(index_dir))
        tokenizer = bm25s.tokenization.Tokenizer(stopwords=[], lower=True)
        tokenizer.load_vocab(str(index_dir))
        tokenizer.load_stopwords(str(index_dir))
        return model, tokenizer

    # ----- search ---------------------------------------------------------------------------
    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        if topk < 1:
            raise ConfigError(f"topk must be >= 1, got {topk}")
        queries = [str(q) for q in queries]
        if not queries:
            return []
        self._ensure_loaded()
        assert self._documents is not None
        k = min(topk, len(self._documents))
        with self._lock:  # the tokenizer and bm25s' scratch buffers are not thread-safe
            tokens = self._tokenizer.tokenize(
                queries, update_vocab=False, show_progress=False, return_as="string"
            )
            # numpy's top-k, as on any machine without JAX: bm25s' "auto" takes JAX where it is
            # installed, which initialises CUDA and fails where the trainer holds the GPU's memory
            # (seen on an H100 host: the retriever died, the run with it)
            indices, scores = self._model.retrieve(tokens, k=k, show_progress=False, n_threads=1,
                                                   backend_selection="numpy")
        # a document with score 0 shares no term with the query (BM25's idf is positive): an
        # empty, stop-word-only or unknown-word query has no hits, not k arbitrary documents
        return [
            [Hit(self._documents[int(i)], float(s)) for i, s in zip(row_i, row_s) if s > 0]
            for row_i, row_s in zip(indices, scores)
        ]


# Process-wide on purpose: an index is read-only once built and keyed by the corpus' resolved
# path, so every env of every run in the process that searches one corpus shares one copy (an
# index is hundreds of MB); nothing a run does changes it. A corpus file rewritten while the
# process lives is not re-read (restart the process, or pass another path).
_SHARED: dict[str, BM25Retriever] = {}
_SHARED_LOCK = threading.Lock()


def shared_bm25(corpus: str | Path | None = None) -> BM25Retriever:
    """The process-wide BM25 retriever of ``corpus`` (built or loaded lazily, on first search)."""
    path = Path(corpus) if corpus is not None else default_corpus_path()
    key = str(path.resolve())
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = BM25Retriever(path)
        return _SHARED[key]

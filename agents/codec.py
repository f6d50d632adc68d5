"""`TokenCodec`: a tokenizer's text -> ids, encoded piece by piece between its added tokens.

A Hugging Face fast tokenizer splits its input on the added tokens (``<|im_start|>``,
``<|im_end|>``, ``<tool_call>`` ...) before anything else and tokenizes each piece between them on
its own. So the ids of a rendered conversation are the concatenation of its pieces' ids, and the
pieces repeat: every episode of a task renders the same system prompt and tool schemas, every
turn the same role headers. `TokenCodec.encode` splits the text on the added tokens itself and
keeps the ids of each piece it has seen (a bounded cache), so an episode pays the tokenizer only
for what is new in it (the question, the tool output), not for the whole prompt again.

This holds only where the pieces are tokenized independently of their position, which the codec
checks from the tokenizer's own description (`tokenizers.Tokenizer.to_str`): no added token
strips the whitespace around it or matches single words only, added tokens match before
normalization, and the normalizer and pre-tokenizer are made of position-free parts (NFC/NFKC,
byte-level, regex and digit splits: Qwen, Llama 3, SmolLM2). Any other tokenizer (a slow one, a
SentencePiece ``Metaspace`` that prepends to the first word only, a test double) is encoded whole
through its own ``encode``, exactly as before.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from palaestra.trace_ranges import span

if TYPE_CHECKING:
    from palaestra.contracts import Tokenizer

# parts of a tokenizer's pipeline that treat each piece the same wherever it stands in the text
_FREE_NORMALIZERS = frozenset({"NFC", "NFKC", "NFD", "NFKD"})
_FREE_PRE_TOKENIZERS = frozenset({"ByteLevel", "Split", "Digits", "Whitespace", "WhitespaceSplit",
                                  "Punctuation"})
_CACHE_ENTRIES = 8192  # distinct pieces kept (a system prompt, headers, tool schemas ...)
_CACHE_PIECE_CHARS = 65_536  # longer pieces are encoded every time, not kept


class TokenCodec:
    """Encodes text with ``tokenizer``, piecewise and cached where that is exact (see above)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._backend: Any = None
        self._split: re.Pattern[str] | None = None
        self._added: dict[str, int] = {}
        self._pieces: dict[str, list[int]] = {}
        self._size = -1  # the vocabulary size (added tokens included) the state was built for
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(tokenizer, "split_special_tokens", False):
            self._backend = backend
            self._build()

    def _build(self) -> None:
        """Read the added tokens (again: tokens added since change how text splits)."""
        backend = self._backend
        self._size = backend.get_vocab_size(with_added_tokens=True)
        self._pieces = {}
        added = _piecewise_added_tokens(backend)
        self._added = added
        # leftmost-longest, as the tokenizer matches them
        names = sorted(added, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, names)) + ")") if added else None

    @property
    def piecewise(self) -> bool:
        """Whether this tokenizer is encoded piece by piece (else whole, by its own encode)."""
        return self._split is not None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens added (what ``tokenizer.encode(text,
        add_special_tokens=False)`` returns)."""
        with span("tokenization"):
            return self._encode(text)

    def _encode(self, text: str) -> list[int]:
        if self._backend is not None and \
                self._backend.get_vocab_size(with_added_tokens=True) != self._size:
            self._build()
        if self._split is None:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        out: list[int] = []
        pieces = self._split.split(text)
        cache, added = self._pieces, self._added
        for i, piece in enumerate(pieces):
            if i % 2:  # a captured added token
                out.append(added[piece])
                continue
            if not piece:
                continue
            ids = cache.get(piece)
            if ids is None:
                ids = self._backend.encode(piece, add_special_tokens=False).ids
                if len(piece) <= _CACHE_PIECE_CHARS:
                    if len(cache) >= _CACHE_ENTRIES:
                        cache.clear()  # a new working set (a new task mix); cheap to refill
                    cache[piece] = ids
            out.extend(ids)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens kept, no clean-up of spaces."""
        with span("tokenization"):
            if self._split is not None:
                return str(self._backend.decode(list(ids), skip_special_tokens=False))
            return str(self.tokenizer.decode(list(ids), skip_special_tokens=False,
                                             clean_up_tokenization_spaces=False))


def _piecewise_added_tokens(backend: Any) -> dict[str, int]:
    """The added tokens' ids by content when ``backend`` tokenizes the pieces between them
    independently (see the module docstring), else an empty dict."""
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # noqa: BLE001 -- not a tokenizers.Tokenizer: encode whole
        return {}
    tokens = spec.get("added_tokens") or []
    if not tokens or spec.get("model", {}).get("dropout") not in (None, 0, 0.0):
        return {}
    for token in tokens:
        if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
            return {}
        if token.get("normalized") and spec.get("normalizer") is not None:
            return {}
    if not _all_of(spec.get("normalizer"), "normalizers", _FREE_NORMALIZERS):
        return {}
    if not _all_of(spec.get("pre_tokenizer"), "pretokenizers", _FREE_PRE_TOKENIZERS):
        return {}
    return {t["content"]: int(t["id"]) for t in tokens if t.get("content")}


def _all_of(part: dict[str, Any] | None, children: str, allowed: frozenset[str]) -> bool:
    if part is None:
        return True
    if part.get("type") == "Sequence":
        return all(_all_of(p, children, allowed) for p in part.get(children) or [])
    return part.get("type") in allowed


_CODECS: weakref.WeakKeyDictionary[Any, TokenCodec] = weakref.WeakKeyDictionary()


def codec_for(tokenizer: Tokenizer) -> TokenCodec:
    """The process's one `TokenCodec` of ``tokenizer`` (its piece cache shared by every agent)."""
    try:
        codec = _CODECS.get(tokenizer)
    except TypeError:  # not weak-referenceable: a codec of its own
        return TokenCodec(tokenizer)
    if codec is None:
        codec = _CODECS[tokenizer] = TokenCodec(tokenizer)
    return codec


__all__ = ["TokenCodec", "codec_for"]

"""Tool use written into the text (Search-R1 tags, fenced python blocks); the parsers live in
core (`palaestra.tool_parsers.text_protocols`), shared with envs, and are re-exported here."""

from palaestra.tool_parsers.text_protocols import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    SEARCH_CLOSE,
    SEARCH_OPEN,
    PythonBlockParser,
    SearchR1Parser,
    extract_answer,
    python_blocks,
)

__all__ = [
    "ANSWER_CLOSE",
    "ANSWER_OPEN",
    "SEARCH_CLOSE",
    "SEARCH_OPEN",
    "PythonBlockParser",
    "SearchR1Parser",
    "extract_answer",
    "python_blocks",
]

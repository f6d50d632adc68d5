"""The shared pieces of the tool-call parsers, which live in core (`palaestra.tool_parsers`) so
that envs parse text actions with the same code; re-exported here for the agents' users."""

from palaestra.tool_parsers.common import (
    THINK_CLOSE,
    THINK_OPEN,
    Parser,
    call_from_fields,
    decode_json_call,
    describe_json_error,
    guess_name,
    number_calls,
    scan_object,
    split_reasoning,
    tag_blocks,
)

__all__ = [
    "THINK_CLOSE",
    "THINK_OPEN",
    "Parser",
    "call_from_fields",
    "decode_json_call",
    "describe_json_error",
    "guess_name",
    "number_calls",
    "scan_object",
    "split_reasoning",
    "tag_blocks",
]

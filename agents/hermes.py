"""Qwen/Hermes tool calls (``<tool_call>{json}</tool_call>``); the parser lives in core
(`palaestra.tool_parsers.hermes`), shared with envs, and is re-exported here."""

from palaestra.tool_parsers.hermes import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, HermesParser

__all__ = ["TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "HermesParser"]

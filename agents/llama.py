"""Llama 3.x tool calls (JSON and ``<|python_tag|>``); the parser lives in core
(`palaestra.tool_parsers.llama`), shared with envs, and is re-exported here."""

from palaestra.tool_parsers.llama import PYTHON_TAG, Llama3Parser

__all__ = ["PYTHON_TAG", "Llama3Parser"]

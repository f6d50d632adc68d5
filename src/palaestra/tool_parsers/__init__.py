"""Tool-call parsers: the decoded text of one assistant turn -> an assistant `Message`.

Pure text in, core types out, so both sides of an episode use the same code: agents parse what
the model sampled (`palaestra.agents` renderers), and an env parses a plain-text action given to
``env.step("...")`` with its ``tool_call_format``. Formats (``name``: aliases):

- ``hermes`` (``qwen``, ``qwen2``, ``qwen2.5``, ``qwen3``): ``<tool_call>{json}</tool_call>``.
- ``llama3`` (``llama``, ``llama3.1``, ``llama3.2``, ``llama3.3``): a JSON call as the message,
  or ``<|python_tag|>`` calls.
- ``search_r1`` (``search-r1``, ``searchr1``): ``<search>query</search>`` tags.
- ``python`` (``python_blocks``, ``code``): fenced python code blocks.
- ``smollm2`` (``smollm``): SmolLM2-Instruct's ``<tool_call>[{json}, ...]</tool_call>`` arrays.
"""

from __future__ import annotations

from palaestra.errors import ConfigError
from palaestra.tool_parsers.common import Parser, number_calls, split_reasoning
from palaestra.tool_parsers.hermes import HermesParser
from palaestra.tool_parsers.llama import Llama3Parser
from palaestra.tool_parsers.smollm2 import SmolLM2Parser
from palaestra.tool_parsers.text_protocols import PythonBlockParser, SearchR1Parser

#: parser name -> parser (parsers are stateless)
PARSERS: dict[str, Parser] = {
    p.name: p
    for p in (HermesParser(), Llama3Parser(), SearchR1Parser(), PythonBlockParser(),
              SmolLM2Parser())
}

#: other accepted names (model family names among them) -> parser name
ALIASES: dict[str, str] = {
    "qwen": "hermes",
    "qwen2": "hermes",
    "qwen2.5": "hermes",
    "qwen3": "hermes",
    "llama": "llama3",
    "llama3.1": "llama3",
    "llama3.2": "llama3",
    "llama3.3": "llama3",
    "search-r1": "search_r1",
    "searchr1": "search_r1",
    "python_blocks": "python",
    "code": "python",
    "smollm": "smollm2",
}


def parser_name(name: str) -> str:
    """The canonical parser name of ``name`` (a parser name or an alias); raises `ConfigError`."""
    key = str(name).strip().lower()
    key = ALIASES.get(key, key)
    if key not in PARSERS:
        names = sorted(set(PARSERS) | set(ALIASES))
        raise ConfigError(f"unknown tool-call format {name!r}; choose one of {names}")
    return key


def get_parser(name: str) -> Parser:
    """The parser of a tool-call format (see the module docstring for the names)."""
    return PARSERS[parser_name(name)]


__all__ = [
    "ALIASES",
    "PARSERS",
    "HermesParser",
    "Llama3Parser",
    "Parser",
    "PythonBlockParser",
    "SearchR1Parser",
    "SmolLM2Parser",
    "get_parser",
    "number_calls",
    "parser_name",
    "split_reasoning",
]

"""Agents: the token level of an episode (conversation -> exact training token ids).

`Agent` keeps the running token ids of one episode in a `TokenTranscript` (sampled tokens
appended exactly, environment messages appended as chat-template deltas computed by
`ChatTemplate`, which the agent gateway uses too), parses each turn with its family's parser, checks
token drift against a full re-render, and emits the `Sample`. `make_agent` and `AgentSpec` build
agents from a tokenizer path and a family name (``qwen``, ``llama3``, ``search_r1``, ``python``).

Nothing heavy is imported here: the tokenizer is passed in or loaded on first use.
"""

from palaestra.agents.agent import Agent, TurnMarks
from palaestra.agents.drift import DriftReport, compare_ids
from palaestra.tool_parsers.hermes import HermesParser
from palaestra.tool_parsers.llama import Llama3Parser
from palaestra.tool_parsers.common import Parser, split_reasoning
from palaestra.agents.renderers import FAMILIES, Renderer, get_renderer
from palaestra.agents.spec import AgentSpec, load_tokenizer, make_agent
from palaestra.agents.templating import ChatTemplate, TemplateDelta, TemplateDeltaError
from palaestra.tool_parsers.text_protocols import PythonBlockParser, SearchR1Parser, extract_answer
from palaestra.agents.transcript import TokenTranscript

__all__ = [
    "FAMILIES",
    "Agent",
    "AgentSpec",
    "ChatTemplate",
    "DriftReport",
    "HermesParser",
    "Llama3Parser",
    "Parser",
    "PythonBlockParser",
    "Renderer",
    "SearchR1Parser",
    "TemplateDelta",
    "TemplateDeltaError",
    "TokenTranscript",
    "TurnMarks",
    "compare_ids",
    "extract_answer",
    "get_renderer",
    "load_tokenizer",
    "make_agent",
    "split_reasoning",
]

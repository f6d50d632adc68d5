"""Building agents: `make_agent`, and `AgentSpec` for processes that build their own (Ray workers).

A tokenizer is not shipped between processes: an `AgentSpec` names its path, and each process
loads it once (`load_tokenizer` keeps a per-process cache) and builds one `Agent` per episode.
The drift check runs on a random ``drift_rate`` fraction of the episodes.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from palaestra.agents.agent import Agent
from palaestra.agents.renderers import get_renderer
from palaestra.errors import ConfigError

if TYPE_CHECKING:
    from palaestra.contracts import Tokenizer


@functools.lru_cache(maxsize=16)
def _load(name: str) -> Tokenizer:
    if (Path(name) / "tokenizer.json").is_file():
        # The generic fast tokenizer reads tokenizer.json as is and, unlike AutoTokenizer, does
        # not import torch: rollout workers only tokenize.
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(name)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer at ``path`` (a model directory), loaded once per process."""
    local = Path(path).expanduser()
    if local.exists():
        return _load(str(local.resolve()))
    if str(path).startswith((".", "/", "~")):
        raise ConfigError(f"no tokenizer at {str(path)!r}: the path does not exist")
    return _load(str(path))  # a hub id, resolved by transformers (from its local cache)


def make_agent(tokenizer_or_path: Tokenizer | str | os.PathLike[str], family: str = "qwen", **kwargs: Any) -> Agent:
    """An `Agent` for a model family; a path is loaded through the per-process cache.

    ``chat_template=`` overrides the family's (else the tokenizer's) template; other keywords go
    to `Agent`.
    """
    tokenizer = (
        load_tokenizer(tokenizer_or_path)
        if isinstance(tokenizer_or_path, (str, os.PathLike))
        else tokenizer_or_path
    )
    renderer = get_renderer(family)
    chat_template = kwargs.pop("chat_template", None)
    if chat_template is not None:  # None keeps the family's template (smollm2 brings its own)
        renderer = renderer.with_template(chat_template)
    if not kwargs.pop("tools_in_prompt", True):
        # the env's own prompt describes its tools (short prompts for small models)
        renderer = dataclasses.replace(renderer, tools_in_template=False)
    return Agent(tokenizer, renderer, **kwargs)


@dataclass(frozen=True)
class AgentSpec:
    """A picklable description of the agents of a run (what a rollout worker needs)."""

    tokenizer_path: str
    family: str = "qwen"
    max_context: int = 4096
    enable_thinking: bool | None = None
    drift_rate: float = 0.0  # fraction of episodes whose Sample carries a drift check
    strict_drift: bool = False
    chat_template: str | None = None
    tools_in_prompt: bool = True  # False: tool schemas stay out of the chat template

    def __post_init__(self) -> None:
        get_renderer(self.family)  # unknown families fail here, not in a worker
        if not 0.0 <= self.drift_rate <= 1.0:
            raise ConfigError(f"drift_rate must be in [0, 1], got {self.drift_rate}")
        if self.max_context < 1:
            raise ConfigError(f"max_context must be positive, got {self.max_context}")

    def build(self, rng: random.Random | None = None) -> Agent:
        """A fresh `Agent`; the tokenizer comes from the process cache.

        An agent may be reused for many episodes (`Agent.start` resets it); each episode draws
        its own drift check with probability ``drift_rate`` (``rng`` seeds those draws).
        """
        return make_agent(
            self.tokenizer_path,
            self.family,
            chat_template=self.chat_template,
            tools_in_prompt=self.tools_in_prompt,
            max_context=self.max_context,
            enable_thinking=self.enable_thinking,
            drift_check=self.drift_rate > 0.0,
            drift_rate=self.drift_rate,
            strict_drift=self.strict_drift,
            drift_seed=rng.getrandbits(63) if rng is not None else None,
        )


__all__ = ["AgentSpec", "load_tokenizer", "make_agent"]

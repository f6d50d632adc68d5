"""A generative judge: a rubric prompt filled with the conversation, sent to an engine, its score
parsed from the reply.

Engines: ``local`` (an embedded `LocalEngine` on a checkpoint), ``palaestra`` / ``sglang`` (a
running server's native /generate over token ids, the prompt rendered by the judge tokenizer's
chat template) and ``openai`` (any OpenAI-compatible chat API: ``palaestra serve``'s /v1, SGLang's
/v1, vLLM, a hosted model). A reply without a score, or with one outside
``[min_score, max_score]``, is a `RewardError` that quotes the reply.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
from collections.abc import Sequence
from typing import Any

from palaestra.rollout.rewards.config import RewardError, RewardSourceConfig
from palaestra.rollout.rewards.render import Conversation, transcript, transcript_content


def fill_template(template: str, messages: Conversation) -> str:
    """The rubric with ``{conversation}``, ``{prompt}`` and ``{response}`` filled in (plain
    replacement: other braces, e.g. JSON in the rubric, stay as written)."""
    users = [m for m in messages if m.get("role") == "user"]
    assistants = [m for m in messages if m.get("role") == "assistant"]
    values = {
        "{conversation}": transcript(messages),
        "{prompt}": transcript_content(users[0]) if users else "",
        "{response}": transcript_content(assistants[-1]) if assistants else "",
    }
    out = template
    for key, value in values.items():
        out = out.replace(key, value)
    return out


def parse_score(reply: str, pattern: str, low: float, high: float) -> float:
    """The last match of ``pattern`` in ``reply`` as a float in ``[low, high]``."""
    found = re.findall(pattern, reply)
    if not found:
        raise RewardError(f"judge reply has no score matching {pattern!r}: {reply[:300]!r}")
    last = found[-1]
    text = last[0] if isinstance(last, tuple) else last
    try:
        value = float(text)
    except ValueError:
        raise RewardError(f"judge score {text!r} is not a number (reply {reply[:300]!r})") from None
    if not math.isfinite(value) or not low <= value <= high:
        raise RewardError(f"judge score {value} is outside [{low}, {high}] (reply "
                          f"{reply[:300]!r}); fix the rubric or min_score/max_score")
    return value


class JudgeSource:
    """A `RewardSource` asking a generative model (see the module docstring)."""

    def __init__(self, cfg: RewardSourceConfig) -> None:
        self.cfg = cfg
        self.name, self.weight, self.per = cfg.part_name, cfg.weight, cfg.per
        self._engine: Any = None
        self._chat: Any = None
        self._tokenizer: Any = None
        self._limit = asyncio.Semaphore(cfg.batch_size)

    def _prompt(self, messages: Conversation) -> list[dict[str, str]]:
        out = [{"role": "system", "content": self.cfg.system}] if self.cfg.system else []
        return out + [{"role": "user", "content": fill_template(str(self.cfg.template), messages)}]

    def _connect(self) -> None:
        cfg = self.cfg
        if self._engine is not None or self._chat is not None:
            return
        if cfg.engine == "openai":
            from palaestra.engines.clients.openai_engine import OpenAIEngine

            key = os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else "none"
            # retries are the reward worker's (it also fails the episode with the reason)
            self._chat = OpenAIEngine(cfg.model, base_url=cfg.url, api_key=key or "none",
                                      max_retries=0, max_concurrency=cfg.batch_size)
            return
        from palaestra.agents import load_tokenizer

        self._tokenizer = load_tokenizer(str(cfg.tokenizer or cfg.path))
        if cfg.engine == "local":
            from palaestra.engines.local.local import LocalEngine

            self._engine = LocalEngine(cfg.path, device=cfg.device, max_running=cfg.batch_size)
        else:
            from palaestra.engines.clients.sglang_client import SGLangClient

            self._engine = SGLangClient(str(cfg.url), retries=0)

    async def reply(self, messages: Conversation) -> str:
        """The judge's raw reply to the rubric about ``messages``."""
        self._connect()
        cfg = self.cfg
        prompt = self._prompt(messages)
        async with self._limit:
            if self._chat is not None:
                msg = await self._chat.chat(prompt, temperature=cfg.temperature,
                                            max_tokens=cfg.max_new_tokens)
                return str(msg.content)
            from palaestra.engine import SamplingParams

            ids = self._tokenizer.apply_chat_template(prompt, tokenize=True,
                                                      add_generation_prompt=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            gen = await self._engine.generate(
                list(ids), SamplingParams(max_new_tokens=cfg.max_new_tokens,
                                          temperature=cfg.temperature))
            if gen.finish_reason == "abort":
                raise RewardError("the judge engine aborted the request")
            return str(self._tokenizer.decode(list(gen.token_ids), skip_special_tokens=True))

    async def score_one(self, messages: Conversation) -> float:
        reply = await self.reply(messages)
        return parse_score(reply, self.cfg.score_pattern, self.cfg.min_score, self.cfg.max_score)

    async def score(self, conversations: Sequence[Conversation]) -> list[float | BaseException]:
        """One score per conversation; a failed one is its exception (the others stand)."""
        return list(await asyncio.gather(*(self.score_one(c) for c in conversations),
                                         return_exceptions=True))

    async def close(self) -> None:
        for engine in (self._engine, self._chat):
            if engine is not None:
                await engine.close()
        self._engine = self._chat = None


__all__ = ["JudgeSource", "fill_template", "parse_score"]

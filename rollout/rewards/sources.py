"""Reward sources: a classifier reward model, a generative judge (`judge.py`) and the env's reward.

A source scores conversations (OpenAI message dicts) and returns one float per conversation, or
the exception that stopped that one (the others stand). The classifier is any Hugging Face
``AutoModelForSequenceClassification`` checkpoint with one label (Bradley-Terry style, e.g. the
``final-model`` of ``palaestra train`` with ``algorithm = "rm"``), scored in batches sorted by
length (right-padded; the model pools its last non-pad token) in a worker thread so the event
loop keeps serving. The env source is not a model: it reads the reward the env gave.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Literal, Protocol

from palaestra.rollout.rewards.config import RewardError, RewardSourceConfig
from palaestra.rollout.rewards.render import Conversation, pad_right, render_ids


class RewardSource(Protocol):
    """What the reward worker calls (see the module docstring)."""

    cfg: RewardSourceConfig
    name: str
    weight: float
    per: Literal["episode", "turn"]

    async def score(self, conversations: Sequence[Conversation]) -> list[float | BaseException]: ...

    async def close(self) -> None: ...


class ClassifierSource:
    """A sequence-classification reward model; ``score`` runs batched forwards in a thread."""

    def __init__(self, cfg: RewardSourceConfig) -> None:
        self.cfg = cfg
        self.name, self.weight, self.per = cfg.part_name, cfg.weight, cfg.per
        self._model: Any = None
        self._tokenizer: Any = None
        self._lock = asyncio.Lock()  # one forward at a time (the model is not re-entrant)

    def load(self) -> None:
        if self._model is not None:
            return
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = str(self.cfg.path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForSequenceClassification.from_pretrained(path)
        except (OSError, ValueError) as exc:
            raise RewardError(f"cannot load the reward model at {path!r} as a Hugging Face "
                              f"sequence-classification checkpoint: {exc}") from exc
        if model.config.num_labels != 1:
            raise RewardError(f"the reward model at {path!r} has {model.config.num_labels} "
                              "labels; a Bradley-Terry reward model has one (num_labels = 1)")
        if model.config.pad_token_id is None:
            pad = tokenizer.pad_token_id
            model.config.pad_token_id = tokenizer.eos_token_id if pad is None else pad
        self._tokenizer, self._model = tokenizer, model.to(self.cfg.device).eval()

    def ids(self, messages: Conversation) -> list[int]:
        self.load()
        ids = render_ids(self._tokenizer, messages)
        if len(ids) > self.cfg.max_length:
            raise RewardError(f"the conversation has {len(ids)} tokens, over the reward model's "
                              f"max_length = {self.cfg.max_length}; raise max_length")
        return ids

    def forward(self, batch: Sequence[Sequence[int]]) -> list[float]:
        """Scores of token-id sequences (right-padded in batches of ``batch_size``)."""
        import torch

        self.load()
        if not batch:
            return []
        pad = int(self._model.config.pad_token_id)
        order = sorted(range(len(batch)), key=lambda i: len(batch[i]))
        out = [0.0] * len(batch)
        size = self.cfg.batch_size
        with torch.inference_mode():
            for start in range(0, len(order), size):
                chunk = order[start:start + size]
                ids, mask = pad_right([batch[i] for i in chunk], pad)
                device = self.cfg.device
                logits = self._model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
                for row, i in enumerate(chunk):
                    out[i] = float(logits[row, 0])
        return out

    async def score(self, conversations: Sequence[Conversation]) -> list[float | BaseException]:
        async with self._lock:
            return await asyncio.to_thread(self._score_sync, conversations)

    def _score_sync(self, conversations: Sequence[Conversation]) -> list[float | BaseException]:
        results: list[float | BaseException] = []
        good: list[int] = []
        ids: list[list[int]] = []
        for i, conv in enumerate(conversations):
            try:
                ids.append(self.ids(conv))
                good.append(i)
                results.append(0.0)
            except RewardError as exc:  # too long: that conversation fails, not the batch
                results.append(exc)
        for i, value in zip(good, self.forward(ids)):
            results[i] = value
        return results

    async def close(self) -> None:
        self._model = None


class EnvSource:
    """The env's own reward (read from the episode, never recomputed)."""

    def __init__(self, cfg: RewardSourceConfig) -> None:
        self.cfg = cfg
        self.name, self.weight, self.per = cfg.part_name, cfg.weight, cfg.per

    async def score(self, conversations: Sequence[Conversation]) -> list[float | BaseException]:
        raise RewardError("the env source reads the episode's rewards; it scores no text")

    async def close(self) -> None:
        return None


def build_source(cfg: RewardSourceConfig) -> RewardSource:
    """The source of one ``[[rewards]]`` entry."""
    if cfg.kind == "classifier":
        return ClassifierSource(cfg)
    if cfg.kind == "judge":
        from palaestra.rollout.rewards.judge import JudgeSource

        return JudgeSource(cfg)
    return EnvSource(cfg)


__all__ = ["ClassifierSource", "EnvSource", "RewardSource", "build_source"]

"""Conversations as reward models see them: one rendering for training (``algorithm = "rm"``)
and for scoring (the classifier source), so a trained reward model is scored on the text it was
trained on.

A conversation is a list of OpenAI message dicts (what `Message.to_dict` and the DPO dataset
rows hold). With a chat template the tokenizer renders it (no generation prompt); without one,
``role: content`` lines. Re-tokenizing text is right here: the reward model is not the policy and
never trains on the policy's tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from palaestra.contracts import Tokenizer

Conversation = Sequence[Mapping[str, Any]]


def render_text(tokenizer: Tokenizer, messages: Conversation) -> str:
    """The conversation as one string for a reward model's tokenizer."""
    wire = [dict(m) for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(wire, tokenize=False))
    return "".join(f"{m['role']}: {transcript_content(m)}\n" for m in wire)


def render_ids(tokenizer: Tokenizer, messages: Conversation) -> list[int]:
    """Token ids of `render_text` (the template already holds the special tokens)."""
    return list(tokenizer(render_text(tokenizer, messages), add_special_tokens=False)["input_ids"])


def transcript_content(message: Mapping[str, Any]) -> str:
    """A message's text with its tool calls written out (``[call name {args}]``)."""
    parts = [str(message.get("content") or "")]
    for call in message.get("tool_calls") or ():
        fn = call.get("function", call)
        args = fn.get("arguments", "{}")
        parts.append(f"[call {fn.get('name', '')} {args if isinstance(args, str) else json.dumps(args)}]")
    return " ".join(p for p in parts if p)


def transcript(messages: Conversation) -> str:
    """``ROLE: text`` lines (a judge's view of the conversation; system messages left out)."""
    return "\n".join(f"{m['role'].upper()}: {transcript_content(m)}" for m in messages
                     if m.get("role") != "system")


def pad_right(batch: Sequence[Sequence[int]], pad_id: int) -> tuple[Any, Any]:
    """``(input_ids, attention_mask)`` tensors of right-padded sequences (a sequence-classification
    model pools its last non-pad token, so the padding changes no score)."""
    import torch

    width = max(len(ids) for ids in batch)
    ids = torch.full((len(batch), width), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, seq in enumerate(batch):
        ids[row, :len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        mask[row, :len(seq)] = 1
    return ids, mask


def turn_prefixes(messages: Conversation, turns: int) -> list[list[dict[str, Any]]]:
    """The conversation up to and including each of the first ``turns`` assistant messages (the
    whole conversation for turns past the last assistant message)."""
    ends = [i + 1 for i, m in enumerate(messages) if m.get("role") == "assistant"]
    out = []
    for k in range(turns):
        end = ends[k] if k < len(ends) else len(messages)
        out.append([dict(m) for m in messages[:end]])
    return out


__all__ = ["Conversation", "pad_right", "render_ids", "render_text", "transcript", "transcript_content",
           "turn_prefixes"]

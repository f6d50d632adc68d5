"""``palaestra/MCPNotes-v0``: the shipped MCP example, a notes store served over stdio.

The server is ``examples/mcp_notes/server.py`` (the official SDK's FastMCP/MCPServer; tools
``put_note``, ``get_note``, ``list_notes``, ``delete_note``), started in the sandbox, one per
episode. Tasks, generated from the reset seed (or given as rows ``{"prompt", "notes",
"ask_count"}``): save one or more notes, and for some tasks say how many notes the store holds.
Reward, read off the server's state after the final answer: the fraction of the asked notes that
are stored with exactly the asked text, averaged with the correctness of the count when asked.
An episode that never reached the server scores 0.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from palaestra.envs.ecosystem.mcp_env import MCPEnv, MCPEpisode, notes_server_path

_KEYS = ("shopping", "todo", "ideas", "books", "travel", "gifts", "recipes", "work", "garden")
_WORDS = ("milk", "eggs", "call mum", "buy stamps", "read dune", "paris", "tea", "fix bike",
          "plant tulips", "send report", "bread", "socks")
_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)


def make_notes_task(rng: np.random.Generator) -> dict[str, Any]:
    """One task: save 1-2 notes; with probability 1/2 also report the number of notes."""
    n = int(rng.integers(1, 3))
    keys = [str(k) for k in rng.choice(_KEYS, size=n, replace=False)]
    notes = {k: str(rng.choice(_WORDS)) for k in keys}
    ask_count = bool(rng.integers(2))
    listed = "; ".join(f"under the key '{k}' the text '{t}'" for k, t in notes.items())
    prompt = f"Using the notes tools, save {listed}."
    if ask_count:
        prompt += " Then tell me how many notes the store holds, as <answer>N</answer>."
    else:
        prompt += " When they are saved, reply <answer>done</answer>."
    task_id = "notes-" + "-".join(f"{k}={t}" for k, t in notes.items()) + f"-{int(ask_count)}"
    return {"id": task_id.replace(" ", "_"), "prompt": prompt, "notes": notes,
            "ask_count": ask_count}


async def notes_reward(episode: MCPEpisode) -> float:
    """Fraction of the notes stored as asked (checked on the server), averaged with the count."""
    if not episode.server_started:
        return 0.0
    notes: Mapping[str, str] = episode.task.get("notes") or {}
    stored = 0
    for key, text in notes.items():
        outcome = await episode.call("get_note", key=key)
        stored += not outcome.is_error and outcome.text == text
    score = stored / len(notes) if notes else 0.0
    if not episode.task.get("ask_count"):
        return score
    listing = await episode.call("list_notes")
    found = _ANSWER.findall(episode.answer)
    expected = _count(listing.text) if not listing.is_error else -1
    correct = bool(found) and found[-1].strip() == str(expected)
    return (score + float(correct)) / 2


def _count(listing: str) -> int:
    """Number of keys in ``list_notes``'s text (one text block per key, or a JSON list)."""
    import json

    text = listing.strip()
    if not text:
        return 0
    try:
        value = json.loads(text)
    except ValueError:
        return len(text.splitlines())
    return len(value) if isinstance(value, list) else len(text.splitlines())


class NotesEnv(MCPEnv):
    """Save notes in an MCP notes server; reward read off the server's state."""

    task_fields: ClassVar[tuple[str | tuple[str, ...], ...]] = ("prompt", "notes")

    def __init__(self, *, max_turns: int = 6, **kwargs: Any) -> None:
        kwargs.setdefault("command", ["python", os.fspath(notes_server_path())])
        kwargs.setdefault("reward", notes_reward)
        super().__init__(max_turns=max_turns, **kwargs)

    def sample_task(self, rng: np.random.Generator) -> dict[str, Any]:
        if self._dataset is not None:
            return super().sample_task(rng)
        return make_notes_task(rng)

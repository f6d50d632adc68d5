"""Reading an outcome from a finished trajectory: correctness and a comparable answer for maj@k.

The env is the authority: a sample is correct when the last turn's ``info["correct"]`` (or
``info["success"]``, the text games' flag) says so or, without it, when the episode reward reaches the benchmark's threshold. The answer used for voting
is the env's ``info["extracted_answer"]`` when it reports one (the same extraction its reward used);
benchmarks whose env does not report it name an extractor (``boxed``, ``hash``, ``tag``) applied to
the last assistant message. Answers are normalised before they are compared.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

from palaestra.types import Trajectory

INFO_ANSWER_KEYS = ("extracted_answer", "answer", "prediction", "parsed_answer")


def final_info(trajectory: Trajectory) -> Mapping[str, Any]:
    return trajectory.turns[-1].info if trajectory.turns else {}


def last_assistant_text(trajectory: Trajectory) -> str:
    for message in reversed(trajectory.messages):
        if message.role == "assistant":
            return message.content
    return ""


def is_correct(trajectory: Trajectory, threshold: float) -> bool:
    if trajectory.failed:
        return False
    info = final_info(trajectory)
    for key in ("correct", "success"):  # the env's own verdict, when it reports one
        if info.get(key) is not None:
            return bool(info[key])
    return trajectory.reward >= threshold - 1e-9


def raw_answer(trajectory: Trajectory, kind: Any) -> Any:
    """The answer before normalisation, or None when the sample gave none."""
    if kind is None:
        return None
    if callable(kind):
        return kind(trajectory)
    info = final_info(trajectory)
    for key in INFO_ANSWER_KEYS:
        if info.get(key) is not None:
            return info[key]
    if kind == "info":
        return None
    from palaestra.envs import rewards

    text = last_assistant_text(trajectory)
    if kind == "boxed":
        return rewards.extract_boxed(text) or rewards.extract_hash_answer(text)
    if kind == "hash":
        return rewards.extract_hash_answer(text) or rewards.extract_boxed(text)
    if kind == "tag":
        return rewards.extract_tag(text, "answer")
    raise ValueError(f"unknown answer kind {kind!r}")


def normalize(answer: Any, how: Any) -> Hashable | None:
    """A hashable form under which equivalent answers compare equal."""
    if answer is None:
        return None
    if callable(how):
        return how(answer)
    if isinstance(answer, (list, tuple)):
        answer = " ".join(str(a) for a in answer)
    text = str(answer).strip()
    if not text:
        return None
    if how == "numeric":
        from palaestra.envs.rewards import numeric_value

        value = numeric_value(text)
        if value is not None:
            return str(value)  # a Fraction: 18, 18.0, $18 and 36/2 all print as 18
        return " ".join(text.replace(" ", "").split())
    if how == "text":
        from palaestra.envs.rewards import normalize_answer

        return normalize_answer(text) or None
    return text


def comparable_answer(trajectory: Trajectory, kind: Any, how: Any) -> Hashable | None:
    if trajectory.failed:
        return None
    return normalize(raw_answer(trajectory, kind), how)


__all__ = [
    "comparable_answer",
    "final_info",
    "is_correct",
    "last_assistant_text",
    "normalize",
    "raw_answer",
]

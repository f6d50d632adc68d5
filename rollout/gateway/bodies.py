"""Strict parsing of the gateway's request bodies: sessions, finish, claim, take, and the fields of
a chat completion the gateway reads.

Each parser checks every field, reports all problems of the body at once (HTTP 400, one message
naming each field) and never coerces (``"x"`` is not a call budget, ``17`` not a group id,
``"no"`` not a boolean). Unknown fields of the gateway's own routes are refused (a typo would
otherwise be ignored silently); chat completions accept the fields of OpenAI's API the gateway
does not read, as OpenAI clients send many.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from palaestra.rollout.gateway.checks import (
    Problems,
    check_bool,
    check_int,
    check_json_bytes,
    check_number,
    check_object,
    check_str,
    describe,
    unknown_keys,
)

SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
MAX_CALLS = 1_000_000
MAX_STOP_WORDS = 16


@dataclass(frozen=True)
class SessionRequest:
    """``POST /sessions``."""

    session_id: str | None = None
    max_calls: int | None = None
    call_timeout_s: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FinishRequest:
    """``POST /sessions/{id}/finish``."""

    reward: float
    group_id: str
    group_size: int | None = None
    task_id: str = ""
    env_id: str = "gateway"


def _body(body: object, p: Problems) -> Mapping[str, Any]:
    return check_object(body, "the body", p) or {}


def parse_session(body: object, *, max_metadata_bytes: int | None) -> SessionRequest:
    p = Problems()
    data = _body(body, p)
    unknown_keys(data, ("session_id", "max_calls", "call_timeout_s", "metadata"), "the body", p)
    sid = data.get("session_id")
    if sid is not None and check_str(sid, "session_id", p) is not None \
            and not SESSION_ID.fullmatch(sid):
        p.add(f"session_id {sid[:40]!r} must be 1-128 characters of letters, digits and ._:- "
              "(it goes into URLs), starting with a letter or digit")
    calls = data.get("max_calls")
    if calls is not None:
        check_int(calls, "max_calls", p, low=1, high=MAX_CALLS)
    timeout = data.get("call_timeout_s")
    if timeout is not None:
        check_number(timeout, "call_timeout_s", p, low=0, low_open=True)
    metadata = data.get("metadata")
    if metadata is not None and check_object(metadata, "metadata", p) is not None:
        check_json_bytes(metadata, "metadata", p, max_metadata_bytes)
    p.raise_if_any("POST /sessions was refused")
    return SessionRequest(sid, calls, None if timeout is None else float(timeout),
                          dict(metadata or {}))


def parse_finish(body: object, *, max_group_size: int | None) -> FinishRequest:
    p = Problems()
    data = _body(body, p)
    unknown_keys(data, ("reward", "group_id", "group_size", "task_id", "env_id"), "the body", p)
    reward = group_id = None
    if "reward" not in data:
        p.add("reward is required (the episode's reward, a number)")
    else:
        reward = check_number(data["reward"], "reward", p)
    if "group_id" not in data:
        p.add("group_id is required (the id, a string, of the group the episode belongs to)")
    else:
        group_id = check_str(data["group_id"], "group_id", p, max_len=512, nonempty=True)
    size = data.get("group_size")
    if size is not None:
        check_int(size, "group_size", p, low=1, high=max_group_size)
    task_id = "" if data.get("task_id") is None else data["task_id"]
    env_id = "gateway" if data.get("env_id") is None else data["env_id"]
    check_str(task_id, "task_id", p, max_len=512)
    check_str(env_id, "env_id", p, max_len=512, nonempty=True)
    p.raise_if_any("finish was refused")
    assert reward is not None and group_id is not None
    return FinishRequest(reward, group_id, size, task_id, env_id)


def parse_claim(body: object) -> str:
    p = Problems()
    data = _body(body, p)
    unknown_keys(data, ("group_id",), "the body", p)
    gid = None
    if "group_id" not in data:
        p.add("claim needs {'group_id': str}")
    else:
        gid = check_str(data["group_id"], "group_id", p, nonempty=True)
    p.raise_if_any("claim was refused")
    assert gid is not None
    return gid


def parse_take(body: object) -> int | None:
    p = Problems()
    data = _body(body, p)
    unknown_keys(data, ("max_groups",), "the body", p)
    limit = data.get("max_groups")
    if limit is not None:
        check_int(limit, "max_groups", p, low=1)
    p.raise_if_any("take was refused")
    return limit


def check_chat_fields(body: Mapping[str, Any], p: Problems) -> None:
    """Type and range checks of the chat-completion fields the gateway reads."""
    for key in ("stream", "logprobs", "parallel_tool_calls"):
        if body.get(key) is not None:
            check_bool(body[key], key, p)
    for key in ("max_tokens", "max_completion_tokens"):
        if body.get(key) is not None:
            check_int(body[key], key, p, low=1)
    if body.get("temperature") is not None:
        check_number(body["temperature"], "temperature", p, low=0, high=2)
    if body.get("top_p") is not None:
        check_number(body["top_p"], "top_p", p, low=0, high=1, low_open=True)
    if body.get("top_k") is not None and check_int(body["top_k"], "top_k", p, low=-1) == 0:
        p.add("top_k must be -1 (off) or >= 1, got 0")
    if body.get("seed") is not None:
        check_int(body["seed"], "seed", p)
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) is not None:
            check_number(body[key], key, p, low=-2, high=2)
    if body.get("model") is not None:
        check_str(body["model"], "model", p)
    if body.get("n") is not None and check_int(body["n"], "n", p) not in (None, 1):
        p.add(f"n={body['n']} is not supported by the gateway: one episode is one "
              "conversation; send n=1 (or leave it out)")
    if body.get("top_logprobs") is not None and check_int(body["top_logprobs"], "top_logprobs",
                                                          p, low=0) not in (None, 0):
        p.add("top_logprobs is not supported by the gateway; leave it out or send 0")
    stop = body.get("stop")
    if stop is not None:
        words = [stop] if isinstance(stop, str) else stop
        if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
            p.add(f"stop must be a non-empty string or a list of them, got {describe(stop)}")
        elif len(words) > MAX_STOP_WORDS:
            p.add(f"stop has {len(words)} sequences; at most {MAX_STOP_WORDS}")
    options = body.get("stream_options")
    if (options is not None and check_object(options, "stream_options", p) is not None
            and options.get("include_usage") is not None):
        check_bool(options["include_usage"], "stream_options.include_usage", p)


__all__ = [
    "FinishRequest",
    "SessionRequest",
    "check_chat_fields",
    "parse_claim",
    "parse_finish",
    "parse_session",
    "parse_take",
]

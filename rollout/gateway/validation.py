"""Strict validation of trajectories posted by external generators (``POST /trajectories``).

Wire format (JSON)::

    {"group_id": "q17",                 # required (here or on each trajectory); a string
     "group_size": 4,                   # optional: the group is complete with 4 trajectories
     "trajectories": [{
        "samples": [{"token_ids": [...], "loss_mask": [...], "logprobs": [...],
                     "versions": [...], "prompt_len": 12, "turn_ends": [...]}],
        "reward": 1.0, "turn_rewards": [...], "stop_reason": "terminated",
        "env_id": "my-env", "task_id": "q17", "metadata": {"difficulty": 3},
        "messages": [{"role": "user", "content": "..."}]}]}

A trajectory may also give one sample's fields (``token_ids``, ``loss_mask``, ``logprobs``, ...)
directly instead of ``samples``; a body without ``trajectories`` is one trajectory. Only
``token_ids``, ``loss_mask``, ``logprobs`` and ``reward`` are required. ``versions`` defaults to
the buffer's policy version on sampled tokens; ``prompt_len`` to the first sampled token.

Every problem of a post is reported at once (each message names its field) and the whole post is
refused: token ids are integers in the vocabulary; loss mask, logprobs and versions have one entry
per token; the mask holds only 0 and 1 and at least one 1; logprobs are finite and sampled ones
are <= 0; rewards are finite; ``prompt_len`` and ``turn_ends`` lie inside the sequence; the stop
reason is a known one; ids are strings (``17`` is not coerced to ``"17"``); metadata is an object.
Types are never coerced. Size caps (`PostLimits`): tokens per sample (the context), samples per
trajectory, metadata bytes, trajectories per group. Numeric metadata becomes trajectory metrics
(``meta/<key>``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from palaestra.errors import TrajectoryValidationError
from palaestra.rollout.gateway.checks import (
    InvalidTrajectoryError,
    Problems,
    check_int,
    check_json_bytes,
    check_number,
    check_object,
    check_str,
    describe,
    is_int,
    is_number,
    unknown_keys,
)
from palaestra.types import Message, Sample, StopReason, Trajectory

SAMPLE_FIELDS = ("token_ids", "loss_mask", "logprobs", "versions", "prompt_len", "turn_ends")
TRAJECTORY_FIELDS = ("group_id", "samples", "reward", "turn_rewards", "stop_reason", "env_id",
                     "task_id", "metadata", "metrics", "messages", "error", *SAMPLE_FIELDS)
POST_FIELDS = ("group_id", "group_size", "trajectories")
MAX_ID_CHARS = 512


class MalformedPayloadError(TrajectoryValidationError):
    """The body is not a trajectory post at all (HTTP 400)."""

    status = 400


class BufferConflictError(TrajectoryValidationError):
    """The post does not fit the buffer's groups: overflow, size conflict, taken group (409)."""

    status = 409


@dataclass(frozen=True)
class PostLimits:
    """Bounds of one post; None means unbounded.

    ``max_tokens``: tokens per sample (the gateway sets the engine's context);
    ``max_samples``: samples per trajectory; ``max_metadata_bytes``: a trajectory's ``metadata``
    as JSON; ``max_group_size``: trajectories of one group (and the largest ``group_size``).
    """

    vocab_size: int | None = None
    max_tokens: int | None = None
    max_samples: int | None = 256
    max_metadata_bytes: int | None = 64 << 10
    max_group_size: int | None = 1024


def finite_number(value: object, where: str) -> float:
    """``value`` as a float, or `TrajectoryValidationError` (booleans and strings refused)."""
    problems = Problems()
    out = check_number(value, where, problems)
    problems.raise_if_any("invalid value", InvalidTrajectoryError)
    assert out is not None
    return out


def _int_list(value: object, where: str, p: Problems) -> list[int] | None:
    if not isinstance(value, list):
        p.add(f"{where} must be a list of integers, got {describe(value)}")
        return None
    bad = [k for k, v in enumerate(value) if not is_int(v)]
    if bad:
        p.add(f"{where}[{bad[0]}] is {value[bad[0]]!r}: expected an integer"
              + (f" ({len(bad)} such entries)" if len(bad) > 1 else ""))
        return None
    return value


def _per_token(value: list[Any] | None, n: int, where: str, p: Problems) -> bool:
    if value is None:
        return False
    if len(value) != n:
        p.add(f"{where} has {len(value)} entries but token_ids has {n}: give one per token")
        return False
    return True


def _sample(data: Any, where: str, p: Problems, limits: PostLimits, version: int,
            check_keys: bool) -> Sample | None:
    """One `Sample` from its wire form, or None with its problems added to ``p``."""
    if check_object(data, where, p) is None:
        return None
    before = len(p)
    missing = [k for k in ("token_ids", "loss_mask", "logprobs") if k not in data]
    for key in missing:
        p.add(f"{where}.{key} is required")
    if check_keys:
        unknown_keys(data, SAMPLE_FIELDS, where, p)
    ids = _int_list(data["token_ids"], f"{where}.token_ids", p) if "token_ids" in data else None
    n = len(ids) if ids is not None else -1
    if ids is not None and n == 0:
        p.add(f"{where}.token_ids is empty")
        ids = None
    if ids is not None and limits.max_tokens is not None and n > limits.max_tokens:
        p.add(f"{where} has {n} tokens; this buffer takes at most {limits.max_tokens} per "
              "sample (the policy's context)")
        ids = None  # per-token checks of a sample that is refused anyway would be wasted
    if ids is not None and limits.vocab_size is not None:
        bad = [k for k, t in enumerate(ids) if not 0 <= t < limits.vocab_size]
        if bad:
            p.add(f"{where}.token_ids[{bad[0]}] = {ids[bad[0]]} is outside the vocabulary "
                  f"[0, {limits.vocab_size}) ({len(bad)} such ids); tokenize with the "
                  "policy's tokenizer")
    mask = _int_list(data["loss_mask"], f"{where}.loss_mask", p) if "loss_mask" in data else None
    if ids is not None and _per_token(mask, n, f"{where}.loss_mask", p):
        assert mask is not None
        if any(m not in (0, 1) for m in mask):
            p.add(f"{where}.loss_mask must contain only 0 and 1")
        elif not any(mask):
            p.add(f"{where}.loss_mask has no 1: the sample has no sampled token to train on")
    raw_lp = data.get("logprobs")
    logprobs: list[float] | None = None
    if "logprobs" in data and not isinstance(raw_lp, list):
        p.add(f"{where}.logprobs must be a list of numbers, got {describe(raw_lp)}")
    elif isinstance(raw_lp, list) and ids is not None and _per_token(raw_lp, n, f"{where}.logprobs", p):
        bad = [k for k, x in enumerate(raw_lp) if not (is_number(x) and math.isfinite(x))]
        if bad:
            p.add(f"{where}.logprobs[{bad[0]}] must be finite numbers, got "
                  f"{describe(raw_lp[bad[0]])}" + (f" ({len(bad)} such)" if len(bad) > 1 else ""))
        else:
            logprobs = [float(x) for x in raw_lp]
            if mask is not None and len(mask) == n:
                positive = [k for k, (x, m) in enumerate(zip(logprobs, mask)) if m and x > 1e-6]
                if positive:
                    p.add(f"{where}.logprobs[{positive[0]}] = {logprobs[positive[0]]}: the logprob "
                          "of a sampled token must be <= 0 (send log-probabilities, not "
                          "probabilities or logits)")
    versions: list[int] | None = None
    if data.get("versions") is not None:
        versions = _int_list(data["versions"], f"{where}.versions", p)
        if ids is not None:
            _per_token(versions, n, f"{where}.versions", p)
    prompt_len = data.get("prompt_len")
    if prompt_len is not None and ids is not None:
        check_int(prompt_len, f"{where}.prompt_len", p, low=0, high=n)
    elif prompt_len is not None:
        check_int(prompt_len, f"{where}.prompt_len", p, low=0)
    raw_ends = data.get("turn_ends")
    ends = _int_list([] if raw_ends is None else raw_ends, f"{where}.turn_ends", p)
    if ends is not None and ids is not None and (
            any(not 0 < e <= n for e in ends) or ends != sorted(ends)):
        p.add(f"{where}.turn_ends must be increasing token indices in (0, {n}]")
    if len(p) > before or ids is None or mask is None or logprobs is None:
        return None
    if versions is None:
        versions = [version if m else -1 for m in mask]
    return Sample(tuple(ids), tuple(mask), tuple(logprobs), tuple(versions),
                  int(prompt_len) if prompt_len is not None else mask.index(1),
                  turn_ends=tuple(ends or ()))


def _trajectory(data: Any, where: str, group_id: str, p: Problems, limits: PostLimits,
                version: int) -> Trajectory | None:
    """One `Trajectory` (its samples carry the reward and group id), or None with problems."""
    if check_object(data, where, p) is None:
        return None
    before = len(p)
    unknown_keys(data, TRAJECTORY_FIELDS, where, p)
    reward = None
    if "reward" not in data:
        p.add(f"{where}.reward is required")
    else:
        reward = check_number(data["reward"], f"{where}.reward", p)
    turn_rewards = _turn_rewards(data, where, p)
    stop = _stop_reason(data, where, p)
    metadata = _metadata(data, where, p, limits)
    env_id = data.get("env_id")
    task_id = data.get("task_id")
    env_id = "external" if env_id is None else check_str(env_id, f"{where}.env_id", p,
                                                         max_len=MAX_ID_CHARS, nonempty=True)
    task_id = "" if task_id is None else check_str(task_id, f"{where}.task_id", p,
                                                   max_len=MAX_ID_CHARS)
    error = data.get("error")
    if error is not None:
        error = check_str(error, f"{where}.error", p)
    pairs, check_keys = _sample_spots(data, where, p, limits)
    parsed = [_sample(raw, spot, p, limits, version, check_keys) for spot, raw in pairs]
    messages = _messages(data, where, p)
    metrics = _metrics(data, metadata, where, p)
    if len(p) > before or reward is None or any(s is None for s in parsed) or not parsed:
        return None
    samples = tuple(Sample(
        s.token_ids_T, s.loss_mask_T, s.logprobs_T, s.versions_T, s.prompt_len,
        reward=reward, turn_rewards=tuple(turn_rewards), stop_reason=stop, env_id=str(env_id),
        task_id=str(task_id), group_id=group_id, turn_ends=s.turn_ends)
        for s in parsed if s is not None)
    metrics["external"] = 1.0
    metrics["response_tokens"] = float(sum(s.num_sampled for s in samples))
    metrics["total_tokens"] = float(sum(s.num_tokens for s in samples))
    return Trajectory(env_id=str(env_id), task_id=str(task_id), messages=messages, turns=(),
                      samples=samples, reward=reward, stop_reason=stop,
                      error=error or None, metrics=metrics, group_id=group_id)


def _turn_rewards(data: Mapping[str, Any], where: str, p: Problems) -> list[float]:
    turn_rewards: list[float] = []
    raw_tr = data.get("turn_rewards")
    if raw_tr is not None and not isinstance(raw_tr, list):
        p.add(f"{where}.turn_rewards must be a list of numbers, got {describe(raw_tr)}")
    for k, r in enumerate(raw_tr if isinstance(raw_tr, list) else ()):
        value = check_number(r, f"{where}.turn_rewards[{k}]", p)
        turn_rewards.append(value if value is not None else 0.0)
    return turn_rewards


def _stop_reason(data: Mapping[str, Any], where: str, p: Problems) -> StopReason:
    stop = StopReason.TERMINATED
    raw_stop = data.get("stop_reason", "terminated")
    try:
        stop = StopReason(raw_stop) if isinstance(raw_stop, str) else StopReason("?")
    except ValueError:
        p.add(f"{where}.stop_reason {raw_stop!r} is not one of {[s.value for s in StopReason]}")
    return stop


def _metadata(data: Mapping[str, Any], where: str, p: Problems,
              limits: PostLimits) -> Mapping[str, Any]:
    metadata = data.get("metadata")
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        p.add(f"{where}.metadata must be an object, got {describe(metadata)}")
        return {}
    check_json_bytes(metadata, f"{where}.metadata", p, limits.max_metadata_bytes)
    return metadata


def _sample_spots(data: Mapping[str, Any], where: str, p: Problems,
                  limits: PostLimits) -> tuple[list[tuple[str, Any]], bool]:
    """Where the samples are (``samples[j]``, or the trajectory itself) and whether their
    keys are still to check."""
    raw_samples = data.get("samples")
    if raw_samples is None:
        return [(where, data)], False  # the trajectory's own keys were checked already
    if not isinstance(raw_samples, list) or not raw_samples:
        p.add(f"{where}.samples must be a non-empty list of samples")
        return [], True
    if limits.max_samples is not None and len(raw_samples) > limits.max_samples:
        p.add(f"{where}.samples has {len(raw_samples)} samples; at most {limits.max_samples}")
        return [], True
    inline = sorted(k for k in SAMPLE_FIELDS if k in data)
    if inline:
        p.add(f"{where} has both 'samples' and sample fields {inline}; give one or the other")
    return [(f"{where}.samples[{j}]", s) for j, s in enumerate(raw_samples)], True


def _messages(data: Mapping[str, Any], where: str, p: Problems) -> tuple[Message, ...]:
    raw_messages = data.get("messages")
    if raw_messages is not None and not isinstance(raw_messages, list):
        p.add(f"{where}.messages must be a list of chat messages, got {describe(raw_messages)}")
    elif raw_messages:
        try:
            return tuple(Message.from_dict(m) for m in raw_messages)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            p.add(f"{where}.messages: {exc}")
    return ()


def _metrics(data: Mapping[str, Any], metadata: Mapping[str, Any], where: str,
             p: Problems) -> dict[str, float]:
    metrics = {f"meta/{k}": float(v) for k, v in metadata.items()
               if is_number(v) and math.isfinite(v)}
    extra = data.get("metrics")
    if extra is not None and not isinstance(extra, Mapping):
        p.add(f"{where}.metrics must be an object of numbers, got {describe(extra)}")
    for k, v in (extra.items() if isinstance(extra, Mapping) else ()):
        value = check_number(v, f"{where}.metrics[{k!r}]", p)
        if value is not None:
            metrics[str(k)] = value
    return metrics


def parse_sample(data: Mapping[str, Any], where: str, *, vocab_size: int | None, version: int,
                 max_tokens: int | None = None) -> Sample:
    """One validated `Sample` (raises `TrajectoryValidationError` listing every problem)."""
    p = Problems()
    out = _sample(data, where, p, PostLimits(vocab_size, max_tokens), version, True)
    p.raise_if_any("invalid sample", InvalidTrajectoryError)
    assert out is not None
    return out


def parse_trajectory(
    data: Mapping[str, Any], where: str, group_id: str, *, vocab_size: int | None, version: int,
    max_tokens: int | None = None, limits: PostLimits | None = None,
) -> Trajectory:
    """One validated `Trajectory` (raises `TrajectoryValidationError` listing every problem)."""
    p = Problems()
    lim = limits or PostLimits(vocab_size, max_tokens)
    out = _trajectory(data, where, group_id, p, lim, version)
    p.raise_if_any("invalid trajectory", InvalidTrajectoryError)
    assert out is not None
    return out


def _group_id(value: object, where: str, p: Problems) -> str | None:
    if value is None:
        p.add(f"{where}.group_id is required: the id (a string) of the group (prompt) it "
              "belongs to")
        return None
    return check_str(value, f"{where}.group_id", p, max_len=MAX_ID_CHARS, nonempty=True)


def parse_post(
    payload: object, *, vocab_size: int | None = None, version: int = 0,
    max_tokens: int | None = None, limits: PostLimits | None = None,
) -> tuple[list[tuple[str, Trajectory]], int | None]:
    """``[(group_id, trajectory), ...]`` and the declared group size of a post.

    Raises `MalformedPayloadError` (not a post at all) or `InvalidTrajectoryError` with every
    problem of the post.
    """
    lim = limits or PostLimits(vocab_size, max_tokens)
    if not isinstance(payload, Mapping):
        raise MalformedPayloadError(
            "the body must be a JSON object: {'group_id': ..., 'trajectories': [...]}")
    wrapped = "trajectories" in payload
    items = payload["trajectories"] if wrapped else [payload]
    if not isinstance(items, list) or not items:
        raise MalformedPayloadError("'trajectories' must be a non-empty list")
    p = Problems()
    if wrapped:
        unknown_keys(payload, POST_FIELDS, "the post", p)
    size = payload.get("group_size")
    if size is not None:
        size = check_int(size, "group_size", p, low=1, high=lim.max_group_size)
    post_gid = payload.get("group_id")
    if post_gid is not None and wrapped:
        post_gid = check_str(post_gid, "group_id", p, max_len=MAX_ID_CHARS, nonempty=True)
    out: list[tuple[str, Trajectory]] = []
    for i, item in enumerate(items):
        where = f"trajectories[{i}]" if wrapped else "trajectory"
        raw_gid = item.get("group_id", post_gid) if isinstance(item, Mapping) else post_gid
        gid = _group_id(raw_gid, where, p) if isinstance(item, Mapping) else None
        traj = _trajectory(item, where, gid or "", p, lim, version)
        if gid is not None and traj is not None:
            out.append((gid, traj))
    if lim.max_group_size is not None:
        for gid, count in Counter(g for g, _ in out).items():
            if count > lim.max_group_size:
                p.add(f"group {gid!r} has {count} trajectories in this post; a group holds at "
                      f"most {lim.max_group_size}")
    p.raise_if_any("the trajectory post was refused", InvalidTrajectoryError)
    return out, size


__all__ = [
    "POST_FIELDS",
    "SAMPLE_FIELDS",
    "TRAJECTORY_FIELDS",
    "BufferConflictError",
    "MalformedPayloadError",
    "PostLimits",
    "finite_number",
    "parse_post",
    "parse_sample",
    "parse_trajectory",
]

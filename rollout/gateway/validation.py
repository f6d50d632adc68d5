"""Strict validation of trajectories posted by external generators (``POST /trajectories``).

Wire format (JSON)::

    {"group_id": "q17",                 # required (here or on each trajectory)
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

Every rule refuses the whole post with a message that names the field: token ids are integers in
the vocabulary; loss mask, logprobs and versions have one entry per token; the mask holds only 0
and 1 and at least one 1; logprobs are finite and sampled ones are <= 0; rewards are finite;
``prompt_len`` and ``turn_ends`` lie inside the sequence; the stop reason is a known one;
metadata is an object. Numeric metadata becomes trajectory metrics (``meta/<key>``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from palaestra.errors import TrajectoryValidationError
from palaestra.types import Message, Sample, StopReason, Trajectory


class MalformedPayloadError(TrajectoryValidationError):
    """The body is not a trajectory post at all (HTTP 400)."""

    status = 400


class BufferConflictError(TrajectoryValidationError):
    """The post does not fit the buffer's groups: overflow, size conflict, taken group (409)."""

    status = 409


def finite_number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TrajectoryValidationError(f"{where} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise TrajectoryValidationError(f"{where} must be finite, got {value!r}")
    return float(value)


def _int_list(value: Any, where: str) -> list[int]:
    if not isinstance(value, list):
        raise TrajectoryValidationError(f"{where} must be a list of integers")
    for k, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TrajectoryValidationError(f"{where}[{k}] is {v!r}: expected an integer")
    return value


def _same_length(value: Sequence[Any], n: int, where: str) -> None:
    if len(value) != n:
        raise TrajectoryValidationError(
            f"{where} has {len(value)} entries but token_ids has {n}: give one per token")


def parse_sample(
    data: Mapping[str, Any], where: str, *, vocab_size: int | None, version: int,
    max_tokens: int | None = None,
) -> Sample:
    """One validated `Sample` from its wire form (raises `TrajectoryValidationError`)."""
    if not isinstance(data, Mapping):
        raise TrajectoryValidationError(f"{where} must be an object")
    for key in ("token_ids", "loss_mask", "logprobs"):
        if key not in data:
            raise TrajectoryValidationError(f"{where}.{key} is required")
    ids = _int_list(data["token_ids"], f"{where}.token_ids")
    n = len(ids)
    if n == 0:
        raise TrajectoryValidationError(f"{where}.token_ids is empty")
    if max_tokens is not None and n > max_tokens:
        raise TrajectoryValidationError(
            f"{where} has {n} tokens; this buffer takes at most {max_tokens} per sample")
    if vocab_size is not None:
        bad = [(k, t) for k, t in enumerate(ids) if not 0 <= t < vocab_size]
        if bad:
            k, t = bad[0]
            raise TrajectoryValidationError(
                f"{where}.token_ids[{k}] = {t} is outside the vocabulary [0, {vocab_size}) "
                f"({len(bad)} such ids); tokenize with the policy's tokenizer")
    mask = _int_list(data["loss_mask"], f"{where}.loss_mask")
    _same_length(mask, n, f"{where}.loss_mask")
    if any(m not in (0, 1) for m in mask):
        raise TrajectoryValidationError(f"{where}.loss_mask must contain only 0 and 1")
    if not any(mask):
        raise TrajectoryValidationError(
            f"{where}.loss_mask has no 1: the sample has no sampled token to train on")
    raw_lp = data["logprobs"]
    if not isinstance(raw_lp, list):
        raise TrajectoryValidationError(f"{where}.logprobs must be a list of numbers")
    _same_length(raw_lp, n, f"{where}.logprobs")
    logprobs = [finite_number(x, f"{where}.logprobs[{k}]") for k, x in enumerate(raw_lp)]
    positive = [k for k, (x, m) in enumerate(zip(logprobs, mask)) if m and x > 1e-6]
    if positive:
        raise TrajectoryValidationError(
            f"{where}.logprobs[{positive[0]}] = {logprobs[positive[0]]}: the logprob of a "
            "sampled token must be <= 0 (send log-probabilities, not probabilities or logits)")
    if data.get("versions") is not None:
        versions = _int_list(data["versions"], f"{where}.versions")
        _same_length(versions, n, f"{where}.versions")
    else:
        versions = [version if m else -1 for m in mask]
    prompt_len = data.get("prompt_len", mask.index(1))
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or not 0 <= prompt_len <= n:
        raise TrajectoryValidationError(f"{where}.prompt_len must be an integer in [0, {n}]")
    ends = _int_list(data.get("turn_ends") or [], f"{where}.turn_ends")
    if any(not 0 < e <= n for e in ends) or ends != sorted(ends):
        raise TrajectoryValidationError(
            f"{where}.turn_ends must be increasing token indices in (0, {n}]")
    return Sample(tuple(ids), tuple(mask), tuple(logprobs), tuple(versions), prompt_len,
                  turn_ends=tuple(ends))


def parse_trajectory(
    data: Mapping[str, Any], where: str, group_id: str, *, vocab_size: int | None, version: int,
    max_tokens: int | None = None,
) -> Trajectory:
    """One validated `Trajectory` (its samples carry the reward and group id)."""
    if not isinstance(data, Mapping):
        raise TrajectoryValidationError(f"{where} must be an object")
    if "reward" not in data:
        raise TrajectoryValidationError(f"{where}.reward is required")
    reward = finite_number(data["reward"], f"{where}.reward")
    turn_rewards = data.get("turn_rewards") or []
    if not isinstance(turn_rewards, list):
        raise TrajectoryValidationError(f"{where}.turn_rewards must be a list of numbers")
    turn_rewards = [finite_number(r, f"{where}.turn_rewards[{k}]")
                    for k, r in enumerate(turn_rewards)]
    try:
        stop = StopReason(data.get("stop_reason", "terminated"))
    except ValueError:
        raise TrajectoryValidationError(
            f"{where}.stop_reason {data.get('stop_reason')!r} is not one of "
            f"{[s.value for s in StopReason]}") from None
    metadata = data.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        raise TrajectoryValidationError(f"{where}.metadata must be an object")
    raw_samples = data.get("samples")
    if raw_samples is None:
        raw_samples = [data]
        spots = [where]
    elif not isinstance(raw_samples, list) or not raw_samples:
        raise TrajectoryValidationError(f"{where}.samples must be a non-empty list")
    else:
        spots = [f"{where}.samples[{j}]" for j in range(len(raw_samples))]
    env_id, task_id = str(data.get("env_id") or "external"), str(data.get("task_id") or "")
    samples = []
    for spot, raw in zip(spots, raw_samples):
        s = parse_sample(raw, spot, vocab_size=vocab_size, version=version, max_tokens=max_tokens)
        samples.append(Sample(
            s.token_ids_T, s.loss_mask_T, s.logprobs_T, s.versions_T, s.prompt_len,
            reward=reward, turn_rewards=tuple(turn_rewards), stop_reason=stop, env_id=env_id,
            task_id=task_id, group_id=group_id, turn_ends=s.turn_ends))
    messages = data.get("messages") or []
    try:
        parsed_messages = tuple(Message.from_dict(m) for m in messages)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise TrajectoryValidationError(f"{where}.messages: {exc}") from None
    metrics = {f"meta/{k}": float(v) for k, v in metadata.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    extra = data.get("metrics") or {}
    if not isinstance(extra, Mapping):
        raise TrajectoryValidationError(f"{where}.metrics must be an object of numbers")
    for k, v in extra.items():
        metrics[str(k)] = finite_number(v, f"{where}.metrics[{k!r}]")
    metrics["external"] = 1.0
    metrics["response_tokens"] = float(sum(s.num_sampled for s in samples))
    metrics["total_tokens"] = float(sum(s.num_tokens for s in samples))
    return Trajectory(env_id=env_id, task_id=task_id, messages=parsed_messages, turns=(),
                      samples=tuple(samples), reward=reward, stop_reason=stop,
                      error=str(data["error"]) if data.get("error") else None,
                      metrics=metrics, group_id=group_id)


def parse_post(
    payload: Any, *, vocab_size: int | None, version: int = 0, max_tokens: int | None = None,
) -> tuple[list[tuple[str, Trajectory]], int | None]:
    """``[(group_id, trajectory), ...]`` and the declared group size of a post."""
    if not isinstance(payload, Mapping):
        raise MalformedPayloadError(
            "the body must be a JSON object: {'group_id': ..., 'trajectories': [...]}")
    items = payload.get("trajectories", None)
    if items is None:
        items = [payload]
    if not isinstance(items, list) or not items:
        raise MalformedPayloadError("'trajectories' must be a non-empty list")
    size = payload.get("group_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise TrajectoryValidationError(f"group_size must be a positive integer, got {size!r}")
    out = []
    for i, item in enumerate(items):
        where = f"trajectories[{i}]" if "trajectories" in payload else "trajectory"
        gid = item.get("group_id", payload.get("group_id")) if isinstance(item, Mapping) else None
        if not isinstance(gid, (str, int)) or isinstance(gid, bool) or str(gid) == "":
            raise TrajectoryValidationError(
                f"{where}.group_id is required: the id of the group (prompt) it belongs to")
        out.append((str(gid), parse_trajectory(item, where, str(gid), vocab_size=vocab_size,
                                               version=version, max_tokens=max_tokens)))
    return out, size


def trajectory_to_wire(traj: Trajectory) -> dict[str, Any]:
    """The JSON form `parse_trajectory` reads back (what `TrajectoryClient` posts)."""
    return {
        "group_id": traj.group_id,
        "env_id": traj.env_id,
        "task_id": traj.task_id,
        "reward": traj.reward,
        "turn_rewards": list(traj.samples[0].turn_rewards) if traj.samples else [],
        "stop_reason": traj.stop_reason.value,
        "error": traj.error,
        "messages": [m.to_dict() for m in traj.messages],
        "metrics": dict(traj.metrics),
        "samples": [
            {"token_ids": list(s.token_ids_T), "loss_mask": list(s.loss_mask_T),
             "logprobs": list(s.logprobs_T), "versions": list(s.versions_T),
             "prompt_len": s.prompt_len, "turn_ends": list(s.turn_ends)}
            for s in traj.samples
        ],
    }


__all__ = [
    "BufferConflictError",
    "MalformedPayloadError",
    "finite_number",
    "parse_post",
    "parse_sample",
    "parse_trajectory",
    "trajectory_to_wire",
]

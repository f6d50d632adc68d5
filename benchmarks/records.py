"""One finished episode as a ``samples.jsonl`` record, per-sample seeds, and engine failures.

A record holds the outcome the metrics need (correct, reward, normalised answer, stop reason, token
counts, timing) next to the full trajectory; `engine_failure` tells a sample the engine lost
(retried in a later run, never stored) from one the model or the env ended (stored as data).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Mapping
from typing import Any

from palaestra.benchmarks.answers import comparable_answer, final_info, is_correct, raw_answer
from palaestra.benchmarks.spec import Benchmark
from palaestra.types import Trajectory

#: Stage prefixes of episode errors that blame the engine, not the model or the env
#: (`run_episode` writes ``engine: ...``, the chat loop ``chat: ...``).
ENGINE_STAGES = ("engine:", "chat:")


def sample_seed(base: int, benchmark: str, task_id: str, index: int) -> int:
    """A stable per-sample seed (same task and index -> same seed on every rerun)."""
    return zlib.crc32(f"{base}/{benchmark}/{task_id}/{index}".encode()) & 0x7FFFFFFF


def make_record(
    benchmark: Benchmark,
    task_id: str,
    index: int,
    model: str,
    seed: int,
    traj: Trajectory,
    elapsed: float,
    *,
    row: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``samples.jsonl`` line of one finished sample. ``gold`` is the env's (its last
    ``info["gold"]``), else the task row's own answer field: an episode cut off before the env
    scored it still shows what the right answer was."""
    answer = comparable_answer(traj, benchmark.answer, benchmark.normalize)
    raw = None if traj.failed else raw_answer(traj, benchmark.answer)
    info = final_info(traj)
    metrics = dict(traj.metrics)
    sample = traj.samples[0] if traj.samples else None
    completion = (
        sample.num_sampled if sample is not None else int(metrics.get("completion_tokens", 0))
    )
    prompt = sample.prompt_len if sample is not None else int(metrics.get("prompt_tokens", 0))
    return {
        "benchmark": benchmark.name,
        "task_id": task_id,
        "sample": index,
        "model": model,
        "seed": seed,
        "correct": is_correct(traj, benchmark.success_threshold),
        "reward": traj.reward,
        "answer": None if answer is None else str(answer),
        "raw_answer": None if raw is None else str(raw),
        "gold": info.get("gold", row_gold(row)),
        # the env's own numbers of the episode (Search-R1: em, f1, searches, answer_in_retrieved)
        "env_metrics": {k: v for k, v in info.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)},
        "stop_reason": traj.stop_reason.value,
        "error": traj.error,
        "turns": len(traj.turns),
        "tool_calls": int(metrics.get("tool_calls", 0)),
        "completion_tokens": int(completion),
        "prompt_tokens": int(prompt),
        "total_tokens": int(metrics.get("total_tokens", completion + prompt)),
        "time_s": round(elapsed, 4),
        "engine_s": round(float(metrics.get("engine_s", 0.0)), 4),
        "env_s": round(float(metrics.get("env_s", 0.0)), 4),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "trajectory": traj.to_json(),
    }


#: the answer fields of task rows, in the order they are tried (Search-R1, NQ, GSM8K-style, ...)
GOLD_FIELDS = ("golden_answers", "answer", "answers", "target", "solution")


def row_gold(row: Mapping[str, Any] | None) -> Any:
    """The gold answer a task row carries (None for generated tasks or rows without one)."""
    for key in GOLD_FIELDS:
        if row is not None and row.get(key) is not None:
            return row[key]
    return None


def engine_failure(traj: Trajectory) -> bool:
    """True when the episode failed because of the engine (retry later), not the model."""
    return traj.error is not None and traj.error.startswith(ENGINE_STAGES)


__all__ = ["ENGINE_STAGES", "GOLD_FIELDS", "engine_failure", "make_record", "row_gold", "sample_seed"]

"""What one RL step logs: its metrics record (``metrics.jsonl``), the console progress bar or
lines, and the note of failed episodes."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from palaestra.progress import Bar, progress_bar

if TYPE_CHECKING:
    from palaestra.rollout.manager import RolloutBatch
    from palaestra.run.run_dir import RunDir

#: one step's metrics line: numbers, and the phase's name
Record = dict[str, object]


def failure_line(step: int, batch: RolloutBatch, run: RunDir) -> str:
    """``[rl step N] k of n episodes failed: 2 x <error>; ...`` (one console line)."""
    finished = int(batch.metrics.get("episodes/finished", 0))
    common = Counter((t.error or t.stop_reason.value).splitlines()[0][:120]
                     for t in batch.failed).most_common(2)
    reasons = "; ".join(f"{n} x {err}" for err, n in common)
    return (f"[rl step {step}] {len(batch.failed)} of {finished} episodes failed: {reasons} "
            f"(all in {run.root / 'failures.jsonl'})")


def step_record(
    step: int, rollout: dict[str, float], train: dict[str, float], sync: dict[str, float],
    *, rollout_s: float, train_s: float, sync_s: float, warmup_steps: int,
) -> Record:
    record: Record = {
        "step": step, "global_step": warmup_steps + step, "phase": "rl",
        "reward_mean": rollout.get("reward/mean", rollout.get("reward_mean")),
    }
    record.update({k: v for k, v in rollout.items() if isinstance(v, (int, float))})
    record.update({f"train/{k}": v for k, v in train.items()})
    record["loss"] = train.get("loss")
    record["response_length_mean"] = rollout.get(
        "response_len/mean", rollout.get("response_length_mean"))
    total = rollout_s + train_s + sync_s
    record.update({
        "time/rollout_s": rollout_s, "time/train_s": train_s, "time/weight_sync_s": sync_s,
        "time/step_s": total, "time/weight_sync_share": sync_s / total if total else 0.0,
        **{f"time/sync_{k}": v for k, v in sync.items()},
    })
    return record


class Progress:
    """The progress bar of the RL steps (or a plain line per step without one)."""

    def __init__(self, bar: Bar | None) -> None:
        self.bar = bar

    def note(self, line: str) -> None:
        """A line above the bar (or a plain line without one)."""
        if self.bar is None:
            print(line, flush=True)
        else:
            self.bar.write(line)

    def update(self, record: Record) -> None:
        if self.bar is None:
            reward = record.get("reward_mean")
            print(f"[rl step {record['step']}] reward {reward:.3f} "
                  f"({record['time/step_s']:.1f} s)", flush=True)
            return
        self.bar.set_postfix(reward=f"{record.get('reward_mean') or 0:.3f}",
                             step_s=f"{record['time/step_s']:.1f}")
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def progress(enabled: bool, total: int, start: int) -> Progress:
    """A bar of ``total`` steps from ``start`` (``logging.progress``; a line every tenth or
    30 s when the output is not a terminal), else a plain line per step."""
    if not enabled:
        return Progress(None)
    return Progress(progress_bar(total, initial=start, desc="rl", unit="step"))


__all__ = ["Progress", "Record", "failure_line", "progress", "step_record"]

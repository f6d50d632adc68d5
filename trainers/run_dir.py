"""The run directory: resolved config, metrics/eval logs, run state, checkpoints and curves.

Layout of ``--out DIR``::

    config.json         the resolved config
    state.json          phase and step reached (written atomically after each checkpoint)
    metrics.jsonl       one object per step: step, phase (sft|rl|dpo), reward_mean, loss, ...
    eval.jsonl          {"stage": "init"|"sft"|"rl"|"step-N", "success_rate": ..., ...}
    checkpoints/        <phase>-<step>/ (backend state + trainer state), newest kept
    curves.png          reward / length / loss curves (matplotlib)
    tb/                 TensorBoard event files
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

COMPLETE = "COMPLETE"


class RunDir:
    """Paths and append-only logs of one run."""

    def __init__(self, root: str | Path, *, tensorboard: bool = False) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.checkpoints = self.root / "checkpoints"
        self._tb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.root / "tb"))
            except ImportError:  # tensorboard is optional
                self._tb = None

    # ----- logs ------------------------------------------------------------------------------
    def _append(self, name: str, record: Mapping[str, Any]) -> None:
        with (self.root / name).open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=float) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def log_metrics(self, record: Mapping[str, Any]) -> None:
        self._append("metrics.jsonl", record)
        if self._tb is not None:
            step = int(record.get("global_step", record.get("step", 0)))
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "global_step"):
                    self._tb.add_scalar(f"{record.get('phase', 'train')}/{key}", value, step)
            self._tb.flush()

    def log_eval(self, record: Mapping[str, Any]) -> None:
        self._append("eval.jsonl", record)

    def read_jsonl(self, name: str) -> list[dict[str, Any]]:
        path = self.root / name
        if not path.exists():
            return []
        rows = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a line cut by a crash: ignore it and what follows
        return rows

    def truncate_metrics_after(self, phase: str, step: int) -> None:
        """Drop metric lines a crashed run wrote after its last checkpoint (they are redone)."""
        path = self.root / "metrics.jsonl"
        if not path.exists():
            return
        order = {"sft": 0, "rl": 1, "dpo": 1}
        keep = [
            r for r in self.read_jsonl("metrics.jsonl")
            if (order.get(r.get("phase", ""), 0), r.get("step", 0)) <= (order.get(phase, 0), step)
        ]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r, default=float) + "\n" for r in keep))
        tmp.replace(path)

    def has_eval(self, stage: str) -> bool:
        return any(r.get("stage") == stage for r in self.read_jsonl("eval.jsonl"))

    # ----- state and checkpoints --------------------------------------------------------------
    def read_state(self) -> dict[str, Any]:
        path = self.root / "state.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def write_state(self, state: Mapping[str, Any]) -> None:
        tmp = self.root / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.root / "state.json")

    def checkpoint_dir(self, phase: str, step: int) -> Path:
        return self.checkpoints / f"{phase}-{step:06d}"

    def mark_complete(self, directory: Path) -> None:
        (directory / COMPLETE).write_text("ok")

    def latest_checkpoint(self, phase: str) -> Path | None:
        if not self.checkpoints.exists():
            return None
        done = sorted(
            d for d in self.checkpoints.glob(f"{phase}-*") if (d / COMPLETE).exists()
        )
        return done[-1] if done else None

    def prune_checkpoints(self, phase: str, keep_last: int) -> None:
        done = sorted(d for d in self.checkpoints.glob(f"{phase}-*") if (d / COMPLETE).exists())
        for old in done[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def plot_curves(run: RunDir) -> Path | None:
    """``curves.png``: reward, response length and loss per step, eval success per stage."""
    rows = run.read_jsonl("metrics.jsonl")
    if not rows:
        return None
    try:
        import matplotlib
    except ImportError:  # plots are optional (e.g. a bare GPU image)
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = run.read_jsonl("eval.jsonl")
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
    for phase, colour in (("sft", "tab:gray"), ("rl", "tab:blue"), ("dpo", "tab:purple")):
        pts = [r for r in rows if r.get("phase") == phase]
        if not pts:
            continue
        x = [r.get("global_step", r["step"]) for r in pts]
        for ax, key in zip(axes[:3], ("reward_mean", "response_length_mean", "loss")):
            ys = [(xi, r[key]) for xi, r in zip(x, pts) if r.get(key) is not None]
            if ys:
                ax.plot(*zip(*ys), label=phase, color=colour)
    for ax, title in zip(axes[:3], ("reward (mean)", "response length (tokens)", "loss")):
        ax.set_title(title)
        ax.set_xlabel("step")
        if ax.get_legend_handles_labels()[0]:  # offline runs have no reward or length curve
            ax.legend(loc="best", fontsize=8)
    if evals:
        axes[3].bar([str(e["stage"]) for e in evals], [e["success_rate"] for e in evals],
                    color="tab:green")
        axes[3].set_ylim(0, 1)
        axes[3].set_title("held-out success rate")
        axes[3].tick_params(axis="x", rotation=45)
    fig.tight_layout()
    out = run.root / "curves.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out

"""The run directory: resolved config, metrics/eval logs, run state, checkpoints and curves.

Layout of ``--out DIR``::

    config.json         the resolved config (a resume with other fixed settings is refused)
    state.json          phase and step reached (written atomically after each checkpoint)
    metrics.jsonl       one object per step: step, phase (sft|rl|dpo), reward_mean, loss, ...
    eval.jsonl          {"stage": "init"|"sft"|"rl"|"step-N", "success_rate": ..., ...}
    failures.jsonl      one object per failed episode: step, env_id, task_id, stop_reason, error
    console.log         what the run printed (progress bars in their final state)
    timing.json         wall time of each phase of the last invocation
    checkpoints/        <phase>-<step>/ (backend state + trainer state), newest kept
    curves.png          reward / length / loss curves (matplotlib)
    tb/                 TensorBoard event files
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO

from palaestra.errors import ConfigError

if TYPE_CHECKING:
    from typing_extensions import Self

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

    def log_failures(self, phase: str, step: int, trajectories: Iterable[Any]) -> int:
        """One ``failures.jsonl`` line per failed episode (a `Trajectory`); returns how many."""
        n = 0
        for t in trajectories:
            self._append("failures.jsonl", {
                "phase": phase, "step": step, "env_id": t.env_id, "task_id": t.task_id,
                "group_id": t.group_id, "stop_reason": t.stop_reason.value, "error": t.error,
            })
            n += 1
        return n

    def read_jsonl(self, name: str) -> list[dict[str, Any]]:
        from palaestra.jsonl import read_jsonl

        path = self.root / name
        # a line cut by a crash: ignore it and what follows
        return read_jsonl(path, bad="stop") if path.exists() else []

    def truncate_metrics_after(self, phase: str, step: int) -> None:
        """Drop metric and failure lines a crashed run wrote after its last checkpoint (they
        are redone)."""
        order = {"sft": 0, "rl": 1, "dpo": 1}
        for name in ("metrics.jsonl", "failures.jsonl"):
            path = self.root / name
            if not path.exists():
                continue
            keep = [
                r for r in self.read_jsonl(name)
                if (order.get(r.get("phase", ""), 0), r.get("step", 0))
                <= (order.get(phase, 0), step)
            ]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r, default=float) + "\n" for r in keep))
            tmp.replace(path)

    def has_eval(self, stage: str, step: int | None = None) -> bool:
        """Whether ``stage`` was evaluated (at ``step``, when given and the record has one)."""
        return any(
            r.get("stage") == stage and (step is None or r.get("step", step) == step)
            for r in self.read_jsonl("eval.jsonl")
        )

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


#: settings a resumed run may change: where and how fast it runs, how long, what it logs and
#: checks (a run stopped by failures may resume with a higher ``max_failure_rate``)
FREE_SETTINGS = (
    "out", "trainer.steps", "checkpoint.", "logging.", "engine.", "benchmark_eval.",
    "rollout.cluster", "rollout.ray_address", "rollout.num_workers", "rollout.max_concurrency",
    "rollout.worker_num_cpus", "rollout.pass_threshold", "rollout.max_failure_rate",
    "agent.drift_rate", "agent.strict_drift", "eval.interval",
    "trainer.torch.device", "trainer.torch.max_tokens_per_micro_batch",
    # where the ranks run: data-parallel ranks give the one-rank steps (to 1e-5), so a run that
    # lost a node resumes on fewer
    "placement", "placement.",
)


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def settings_differences(
    previous: Mapping[str, Any], current: Mapping[str, Any], free: Iterable[str] = FREE_SETTINGS,
    *, both_only: bool = False,
) -> list[str]:
    """``"key: old -> new"`` for each fixed setting (not under a ``free`` prefix) that differs;
    ``both_only`` compares only the settings both configs have."""
    free = tuple(free)
    old, new = _flatten(previous), _flatten(current)
    keys = set(old) & set(new) if both_only else set(old) | set(new)
    lines = []
    for key in sorted(keys):
        if any(key == f or (f.endswith(".") and key.startswith(f)) for f in free):
            continue
        if old.get(key, "(unset)") != new.get(key, "(unset)"):
            lines.append(f"{key}: {old.get(key, '(unset)')!r} -> {new.get(key, '(unset)')!r}")
    return lines


def check_resume(
    root: str | Path, current: Mapping[str, Any],
    normalize: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> None:
    """Refuse to go on with the run directory ``root`` when its recorded fixed settings differ
    from ``current`` (the resolved config as JSON data); a finished run may only grow its steps.
    Reads only: a refused run directory is left as it was.

    ``normalize`` re-resolves the recorded config with this version's schema (fields added since
    then take their defaults); where it fails, only the settings both configs have are compared.
    """
    root = Path(root)
    try:
        previous = json.loads((root / "config.json").read_text())
        state = json.loads((root / "state.json").read_text())
    except (OSError, json.JSONDecodeError):
        return  # nothing was trained here yet
    both_only = normalize is None
    if normalize is not None:
        try:
            previous = normalize(previous)
        except Exception:  # noqa: BLE001 -- e.g. a field removed since: compare what both have
            both_only = True
    problems = settings_differences(previous, current, both_only=both_only)
    reached = int(state.get("step", 0) or 0)
    steps = int(_flatten(current).get("trainer.steps", reached))
    if state.get("phase") == "done" and steps < reached:
        problems.append(f"trainer.steps: {steps} is fewer than the {reached} steps this run "
                        "already trained (a finished run can only be extended)")
    if problems:
        lines = "\n  - ".join(problems)
        raise ConfigError(
            f"{root} holds a run made with other settings; these may not change on resume:"
            f"\n  - {lines}\nresume with the same settings, start over with --no-resume, or "
            "choose another --out (a larger --trainer.steps extends a finished run)"
        )


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class _Tee:
    """A text stream that also appends to a log file, keeping only the final state of lines
    redrawn with carriage returns (progress bars) and no terminal escape codes."""

    def __init__(self, stream: TextIO, log: TextIO) -> None:
        self._stream, self._log = stream, log
        self._line, self._cr = "", False

    def write(self, text: str) -> int:
        n = self._stream.write(text)
        for part in re.split(r"(\r|\n)", _ANSI.sub("", text)):
            if part == "\n":
                if self._line.strip():
                    self._log.write(self._line.rstrip() + "\n")
                    self._log.flush()
                self._line, self._cr = "", False
            elif part == "\r":
                self._cr = True  # what follows redraws the line
            elif part:
                if self._cr:
                    self._line, self._cr = "", False
                self._line += part
        return n

    def flush(self) -> None:
        self._stream.flush()

    def close_line(self) -> None:
        if self._line.strip():
            self._log.write(self._line.rstrip() + "\n")
        self._line = ""
        self._log.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding... of the console
        return getattr(self._stream, name)


class ConsoleLog:
    """``with ConsoleLog(run.root / "console.log"):`` copies stdout and stderr into the file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: TextIO | None = None
        self._saved: tuple[TextIO, TextIO] | None = None

    def __enter__(self) -> Self:
        self._file = self.path.open("a", encoding="utf-8")
        self._saved = (sys.stdout, sys.stderr)
        sys.stdout = _Tee(sys.stdout, self._file)  # type: ignore[assignment]
        sys.stderr = _Tee(sys.stderr, self._file)  # type: ignore[assignment]
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._saved is not None and self._file is not None
        for tee in (sys.stdout, sys.stderr):
            if isinstance(tee, _Tee):
                tee.close_line()
        sys.stdout, sys.stderr = self._saved
        if exc is not None and not isinstance(exc, KeyboardInterrupt):
            import traceback  # the console gets it from the interpreter, after this exit

            self._file.write("".join(traceback.format_exception(kind, exc, tb)))
        self._file.close()


def tool_calls_title(env_id: str | None) -> str:
    """The tool-call panel's title, in the env's words: a search env's tool calls are searches;
    any other env's are its tool calls, named with the env."""
    if env_id is None:
        return "tool calls per episode"
    if "search" in env_id.lower():
        return "searches per episode"
    return f"tool calls per episode ({env_id.rsplit('/', 1)[-1]})"


def _plot_tool_calls(ax: Any, rows: list[dict[str, Any]], evals: list[dict[str, Any]],
                     title: str) -> None:
    """Tool calls per episode over the RL steps; the held-out stages' means in the legend."""
    pts = [(r.get("global_step", r["step"]), r["tool_calls/mean"]) for r in rows
           if r.get("phase") == "rl" and r.get("tool_calls/mean") is not None]
    held = ", ".join(f"{e['stage']} {e['tool_calls_mean']:.2f}" for e in evals
                     if e.get("tool_calls_mean") is not None)
    if pts:
        ax.plot(*zip(*pts), color="tab:orange", label="rollouts")
    if held:
        ax.plot([], [], " ", label=f"held-out: {held}")
    ax.set_title(title)
    ax.set_xlabel("step")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=8)


#: (metrics key, label) of the critic panels of a PPO run (value fit, then losses)
_CRITIC_CURVES = (
    (("train/ppo/explained_variance", "explained variance"),
     ("train/ppo/value_mean", "mean value"), ("train/ppo/return_mean", "mean return")),
    (("train/critic/value_loss", "value loss"),
     ("train/critic/value_clip_frac", "value clip fraction"),
     ("train/ppo/advantage_std", "advantage std (raw GAE)")),
)


def _plot_critic(axes: Any, rows: list[dict[str, Any]]) -> None:
    """PPO's critic: how well the values fit the returns, and its loss."""
    rl = [r for r in rows if r.get("phase") == "rl"]
    for ax, curves, title in zip(axes, _CRITIC_CURVES, ("critic: values vs returns",
                                                        "critic: value loss")):
        for key, label in curves:
            pts = [(r.get("global_step", r["step"]), r[key]) for r in rl
                   if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)


def plot_curves(run: RunDir, env_id: str | None = None) -> Path | None:
    """``curves.png``: reward, response length and loss per step, eval success per stage, tool
    calls per episode (titled for ``env_id``: `tool_calls_title`); with a critic (PPO) also
    explained variance, mean value vs mean return, value loss and clip fraction."""
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
    critic = any(r.get("train/ppo/explained_variance") is not None for r in rows)
    fig, axes = plt.subplots(1, 7 if critic else 5, figsize=(31 if critic else 22, 3.8))
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
    _plot_tool_calls(axes[4], rows, evals, tool_calls_title(env_id))
    if critic:
        _plot_critic(axes[5:], rows)
    fig.tight_layout()
    out = run.root / "curves.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out

"""``report.md`` and its PNG plots: an overview table, then per benchmark a metric table, the pass@k
(and maj@k) curve, reward and response-length histograms, stop reasons, and two example samples.

Plots use matplotlib's non-interactive Agg backend (no display needed) and land in ``plots/``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPORT = "report.md"
PLOTS = "plots"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.4f}"
    if value is None:
        return "-"
    return str(value)


def _plots(out_dir: Path, name: str, summary: Mapping[str, Any], records: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    folder = out_dir / PLOTS
    folder.mkdir(parents=True, exist_ok=True)
    made: dict[str, str] = {}

    def save(fig: Any, key: str) -> None:
        path = folder / f"{name}_{key}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        made[key] = f"{PLOTS}/{path.name}"

    n = int(summary.get("n") or 0)
    ks = list(range(1, n + 1))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(ks, [summary.get(f"pass@{k}", math.nan) for k in ks], marker="o", label="pass@k")
    if f"maj@{n}" in summary:
        ax.plot(ks, [summary.get(f"maj@{k}", math.nan) for k in ks], marker="s", label="maj@k")
    ax.set_xlabel("k (samples)")
    ax.set_ylabel("score")
    ax.set_ylim(0, 1.02)
    ax.set_xticks(ks if n <= 16 else ks[:: max(1, n // 8)])
    ax.set_title(f"{name}: pass@k")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, "pass_at_k")

    rewards = [float(r.get("reward", 0.0)) for r in records]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    distinct = sorted(set(rewards))
    if len(distinct) <= 10:  # few values (0/1 rewards): one bar per value
        labels = [f"{v:g}" for v in distinct]
        ax.bar(labels, [rewards.count(v) for v in distinct], color="tab:green")
    else:
        ax.hist(rewards, bins=20, color="tab:green")
    ax.set_xlabel("episode reward")
    ax.set_ylabel("samples")
    ax.set_title(f"{name}: rewards")
    save(fig, "rewards")

    lengths = [int(r.get("completion_tokens", 0)) for r in records]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.hist(lengths, bins=30, color="tab:blue")
    ax.set_xlabel("generated tokens per episode")
    ax.set_ylabel("samples")
    ax.set_title(f"{name}: response length")
    save(fig, "lengths")

    reasons = summary.get("stop_reasons") or {}
    fig, ax = plt.subplots(figsize=(5, 3.5))
    labels = sorted(reasons, key=lambda k: -reasons[k])
    ax.bar(labels, [reasons[k] for k in labels], color="tab:orange")
    ax.set_ylabel("samples")
    ax.set_title(f"{name}: stop reasons")
    ax.tick_params(axis="x", rotation=20)
    save(fig, "stop_reasons")
    return made


def _example(record: Mapping[str, Any], limit: int = 400) -> list[str]:
    messages = (record.get("trajectory") or {}).get("messages") or []
    question = next((m.get("content", "") for m in messages if m.get("role") == "user"), "")
    final = next(
        (m.get("content", "") for m in reversed(messages) if m.get("role") == "assistant"), ""
    )

    def clip(text: str) -> str:
        text = text.strip().replace("```", "'''")
        return text if len(text) <= limit else text[:limit] + " ..."

    return [
        f"- task `{record.get('task_id')}`, sample {record.get('sample')}: reward "
        f"{_fmt(float(record.get('reward', 0.0)))}, stop `{record.get('stop_reason')}`, "
        f"answer `{record.get('answer')}`",
        "",
        "  ```text",
        *("  " + line for line in clip(question).splitlines()),
        "  --- final assistant message ---",
        *("  " + line for line in clip(final).splitlines()),
        "  ```",
    ]


def _full(out: Path, record: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The record with its trajectory, read back from the run's samples file."""
    from palaestra.benchmarks.store import SAMPLES, find_record, key_of

    path = out / SAMPLES
    return find_record(path, key_of(record)) if path.exists() else None


def write_report(
    out_dir: str | Path,
    summaries: Mapping[str, Mapping[str, Any]],
    records_by_benchmark: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    header: Mapping[str, Any] | None = None,
    descriptions: Mapping[str, str] | None = None,
) -> Path:
    """Write ``report.md`` and the PNGs it links; returns the report's path."""
    out = Path(out_dir)
    lines = ["# Evaluation report", ""]
    if header:
        lines += ["| setting | value |", "|---|---|"]
        for key, value in header.items():
            lines.append(f"| {key} | {'default' if value is None else value} |")
    lines += ["", "## Overview", ""]
    lines.append("| benchmark | tasks | n | pass@1 | pass@n | maj@n | mean reward | errors |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, s in summaries.items():
        n = s.get("n", 0)
        lines.append(
            f"| {name} | {s.get('tasks')} | {n} | {_fmt(s.get('pass@1'))} | "
            f"{_fmt(s.get(f'pass@{n}'))} | {_fmt(s.get(f'maj@{n}'))} | {_fmt(s.get('mean'))} | "
            f"{s.get('errors')} |"
        )
    for name, s in summaries.items():
        records = records_by_benchmark.get(name, [])
        lines += ["", f"## {name}", ""]
        if descriptions and descriptions.get(name):
            lines += [descriptions[name], ""]
        lines += ["| metric | value |", "|---|---:|"]
        for key, value in s.items():
            if key in ("stop_reasons", "model", "env_metrics"):
                continue
            lines.append(f"| {key} | {_fmt(value)} |")
        for key, value in (s.get("env_metrics") or {}).items():  # the env's own, e.g. f1
            lines.append(f"| env: {key} | {_fmt(value)} |")
        lines += ["", "| stop reason | samples |", "|---|---:|"]
        for reason, count in sorted((s.get("stop_reasons") or {}).items(), key=lambda kv: -kv[1]):
            lines.append(f"| {reason} | {count} |")
        if records:
            plots = _plots(out, name, s, records)
            lines.append("")
            for key, title in (
                ("pass_at_k", "pass@k"),
                ("rewards", "rewards"),
                ("lengths", "response length"),
                ("stop_reasons", "stop reasons"),
            ):
                lines.append(f"![{name} {title}]({plots[key]})")
            right = next((r for r in records if r.get("correct")), None)
            wrong = next((r for r in records if not r.get("correct")), None)
            for label, record in (("A correct sample", right), ("An incorrect sample", wrong)):
                if record is not None and "trajectory" not in record:
                    record = _full(out, record) or record
                if record is not None:
                    lines += ["", f"**{label}**", "", *_example(record)]
    path = out / REPORT
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


__all__ = ["PLOTS", "REPORT", "write_report"]

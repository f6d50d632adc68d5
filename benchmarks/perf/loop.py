"""The RL loop end to end: ``palaestra train``'s own code over a {backend} x {mode} x shape matrix.

GPU (one H200, megatron-core installed for the megatron cells), from the repository root::

    python -m palaestra.benchmarks.perf.loop --device cuda --shapes qwen3-0.6b,qwen3-1.7b \
        --backends torch,megatron --modes sync,async --steps 5 --json loop.json

The issue-45 workload with a trace of one steady step per cell (one H200: every cell in one
call: the default variant is the embedded engine; the served cells' engine is another process,
see `palaestra.benchmarks.perf.idle`)::

    python -m palaestra.benchmarks.perf.loop --device cuda --shapes qwen3-0.6b \
        --backends torch,megatron --modes sync,async --steps 4 --trace \
        --extra "--engine.max_running 256" \
        --variant "served=--engine.kind sglang --engine.launch palaestra \
            --engine.launch_gpus [0] --engine.weight_sync.kind ipc" \
        --json docs/results/loop_0.6b_trace_<date>.json

CPU (the tiny quickstart model, a small batch; what CI runs so the script cannot rot)::

    python -m palaestra.benchmarks.perf.loop --device cpu --json loop_cpu.json
    python -m palaestra.benchmarks.perf.loop --device cpu --modes sync --trace   # host time

Shapes (`palaestra.benchmarks.perf.shapes`): ``qwen3-0.6b``/``qwen3-1.7b`` are the real model
cards (head_dim 128, a vocabulary of 151,936: 596M/1.72B parameters) with the quickstart
tokenizer padded to that vocabulary; ``qwen3-0.6b-legacy``/``qwen3-1.7b-legacy`` the shapes of
the figures before 2026-12-04 (head_dim 64, a ~760-entry vocabulary: 353M parameters);
``tiny``, ``10m``... the `palaestra.tiny_model` sizes. The table shows each cell's parameters.

``--trace`` profiles step ``--skip`` (the first steady one) of every cell: a ``torch.profiler``
trace (CUDA activity on a GPU) written beside the cell as ``trace-step<N>.json.gz``, and the
step's GPU idle seconds by cause (engine step host time, admission/stop checks, tokenization,
env and agent, HTTP, trainer data, optimizer, weight sync, and ``other``), from the host ranges
the code marks (`palaestra.trace_ranges`) against the kernel timeline; without a GPU, the host
time of the step by the same causes. Printed as a second table, in the JSON as ``trace``.

Each cell is one ``palaestra train configs/quickstart.toml`` run (the issue-22 workload on GPU:
random-init Qwen3 models with the quickstart's tokenizer, Calculator env, 32 prompts x 8,
256 new tokens, no warm-up SFT, no evaluation) in its own subprocess, so every cell starts with
a clean GPU and process group. The child builds the `TrainConfig` exactly as the CLI does
(`palaestra.config.load_config` on the same overrides), calls `trainers.loop.train`, and
samples GPU utilisation (NVML) while it runs. Reported per cell, as the mean over the steady
steps (step 0 compiles kernels and captures graphs; ``--skip`` steps are dropped):

- step, rollout (the wait for the batch; in async mode what generation did not hide), the
  reference-logprob forward inside the train step (``logprobs_s``; 0 without a KL term: the
  loop takes the old logprobs from the rollout, so it runs no other logprob forward), train
  (that forward included), weight sync, and idle GPU time (the step time the NVML sampler saw
  the GPU without a running kernel), in seconds;
- tokens/s (the trained tokens over the step time) and the RL-pipeline MFU:
  ``12 * N * tokens / (step time * 989 TFLOP/s)`` (12N = 2N generation + 2N logprobs + 6N
  training + 2N for the rest, as issue 22 counts; N = the model's parameters, and a second
  figure with the shape's nominal size, which is what the issue used);
- episodes parked and resumed per step, train micro-batches, peak GPU memory (allocated).

``--extra "--engine.max_running 256"`` adds overrides to every cell (a named variant with
``--variant NAME=OVERRIDES``, repeatable). Prints a markdown table; ``--json OUT`` writes it all,
after every cell (a killed matrix keeps the cells it finished). Each cell's run directory is
deleted once its metrics are read (a 1.7B cell's checkpoints are ~25 GB): ``--keep-runs``.
For each backend, async vs sync says whether overlap on one device pays (>= 1.15x) or
recommends the disaggregated layout.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

DATASHEET_TFLOPS = 989.0
#: nominal sizes of the named shapes (what "0.6B" means in the issue's MFU figure)
NOMINAL_PARAMS = {"qwen3-0.6b": 0.6e9, "qwen3-1.7b": 1.7e9, "qwen3-0.6b-legacy": 0.6e9,
                  "qwen3-1.7b-legacy": 1.7e9, "tiny": None}
STEP_KEYS = {
    "step_s": "time/step_s", "rollout_s": "time/rollout_s", "train_s": "time/train_s",
    "weight_sync_s": "time/weight_sync_s", "logprobs_s": "train/logprobs_s",
    "tokens": "train/num_tokens", "micro_batches": "train/num_micro_batches",
    "backend_train_s": "train/step_time_s", "parked": "episodes/parked",
    "resumed": "episodes/resumed", "reward": "reward_mean",
    "response_len": "response_length_mean",
    # the embedded engine's scheduler (see LocalEngine.stats): compute calls vs the rest
    "engine_decode_s": "engine/decode_s", "engine_prefill_s": "engine/prefill_s",
    "engine_host_s": "engine/host_s", "decode_calls": "engine/decode_calls",
    "decode_steps": "engine/decode_steps", "prefill_steps": "engine/prefill_steps",
}


# ------------------------------------------------------------------------------------- cells
def workload(args: argparse.Namespace, shape: str) -> list[str]:
    """The ``palaestra train`` overrides of one shape (the issue-22 command on GPU)."""
    if args.device == "cpu":
        return [
            "--engine.device", "cpu", "--trainer.torch.device", "cpu",
            "--rollout.batch_size", str(args.batch_size or 4),
            "--rollout.group_size", str(args.group_size or 2),
            "--rollout.max_new_tokens", str(args.max_new_tokens or 16),
            "--warmup.steps", "0", "--trainer.steps", str(args.steps), "--eval.num_tasks", "0",
            "--data.num_tasks", "64", "--trainer.loss.entropy_coef", "0.01",
            "--rollout.cluster", "local", "--logging.progress", "false",
        ]
    return [
        "--engine.device", "cuda", "--trainer.torch.device", "cuda", "--rollout.cluster", "local",
        "--rollout.batch_size", str(args.batch_size or 32),
        "--rollout.group_size", str(args.group_size or 8),
        "--rollout.max_new_tokens", str(args.max_new_tokens or 256),
        "--warmup.steps", "0", "--trainer.steps", str(args.steps), "--eval.num_tasks", "0",
        "--trainer.loss.entropy_coef", "0.01", "--trainer.torch.lr", "1e-5",
        "--trainer.megatron.lr", "1e-5", "--logging.progress", "false",
    ]


def cell_overrides(args: argparse.Namespace, backend: str, mode: str, shape: str,
                   model_dir: Path, out: Path, extra: list[str]) -> list[str]:
    return [
        *workload(args, shape), "--model.path", str(model_dir), "--out", str(out),
        "--trainer.backend", backend, "--rollout.mode", mode, "--checkpoint.resume", "false",
        *extra,
    ]


def ensure_shape_model(shape: str, path: Path) -> Path:
    """A random-init model of ``shape`` at ``path`` (built once): a named shape from its real
    model card with the padded quickstart tokenizer, ``*-legacy`` the shapes of the figures
    before 2026-12-04, a `palaestra.tiny_model` size as ``init-model`` builds it
    (`palaestra.benchmarks.perf.shapes`)."""
    from palaestra.benchmarks.perf.shapes import build_shape_model

    return build_shape_model(shape, path)


# ------------------------------------------------------------------------------------- child
class _Sampler(threading.Thread):
    """GPU utilisation (NVML, every ``period`` s) and the times metrics.jsonl grew (step ends)."""

    def __init__(self, metrics_file: Path, period: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.metrics_file = metrics_file
        self.period = period
        self.samples: list[tuple[float, float]] = []
        self.step_ends: list[float] = []
        self.stop = threading.Event()
        self.handle: Any = None
        self._util: Any = None  # no NVML (CPU machines): step boundaries only
        try:
            import pynvml
        except ImportError:
            return
        try:
            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except pynvml.NVMLError:
            return
        self._util = lambda: float(pynvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)

    def run(self) -> None:
        lines = 0
        while not self.stop.is_set():
            now = time.perf_counter()
            if self._util is not None:
                self.samples.append((now, self._util()))
            if self.metrics_file.exists():
                n = self.metrics_file.read_bytes().count(b"\n")
                self.step_ends.extend([now] * (n - lines))
                lines = n
            time.sleep(self.period)

    def idle_per_step(self, step_s: list[float]) -> list[float | None]:
        """Seconds of each step with the GPU idle (1 - utilisation, NVML's own averaging)."""
        out: list[float | None] = []
        for i, end in enumerate(self.step_ends):
            start = end - step_s[i] if i < len(step_s) else end
            util = [u for t, u in self.samples if start <= t <= end]
            out.append((1 - statistics.fmean(util) / 100) * (end - start) if util else None)
        return out


def child(spec_file: Path) -> int:
    """Run one cell (the spec written by the parent) and write its raw result beside it."""
    spec = json.loads(spec_file.read_text())
    from palaestra.config import load_config
    from palaestra.run.config import TrainConfig
    from palaestra.run.train import train

    cfg = load_config(TrainConfig, spec["config"], spec["overrides"])
    traced = None
    if spec.get("trace_step") is not None:
        from palaestra.benchmarks.perf.idle import trace_step

        traced = trace_step(int(spec["trace_step"]), spec_file.parent)
    sampler = _Sampler(Path(cfg.out) / "metrics.jsonl")
    sampler.start()
    start = time.perf_counter()
    train(cfg)
    wall = time.perf_counter() - start
    time.sleep(3 * sampler.period)
    sampler.stop.set()
    sampler.join()
    rows = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("phase") == "rl"]
    result: dict[str, Any] = {"wall_s": wall, "steps": rows}
    idle = sampler.idle_per_step([r["time/step_s"] for r in rows])
    for r, seconds in zip(rows, idle):
        r["idle_gpu_s"] = seconds
    if traced is not None:
        from palaestra.benchmarks.perf.idle import finish

        step = int(spec["trace_step"])
        step_s = next((r["time/step_s"] for r in rows if r.get("step") == step), None)
        result["trace"] = finish(traced, step_s)
    import torch

    from palaestra.benchmarks.perf.shapes import parameter_count

    result["params"] = parameter_count(Path(spec["model_dir"]))
    if torch.cuda.is_available():
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        result["device_name"] = torch.cuda.get_device_name()
    (spec_file.parent / "result.json").write_text(json.dumps(result))
    return 0


# ------------------------------------------------------------------------------------ parent
def summarize(raw: dict[str, Any], skip: int, nominal: float | None) -> dict[str, Any]:
    """Means over the steady steps, tokens/s, MFU, memory."""
    steps = raw["steps"][skip:] or raw["steps"]
    out: dict[str, Any] = {"steady_steps": len(steps)}
    for name, key in STEP_KEYS.items():
        vals = [float(s[key]) for s in steps if s.get(key) is not None]
        out[name] = statistics.fmean(vals) if vals else None
    idle = [s["idle_gpu_s"] for s in steps if s.get("idle_gpu_s") is not None]
    out["idle_gpu_s"] = statistics.fmean(idle) if idle else None
    step_s, tokens = out["step_s"], out["tokens"] or 0.0
    out["tokens_per_s"] = tokens / step_s if step_s else None
    params = raw["params"]
    out["params"] = params
    flops = 12 * params * tokens
    out["mfu"] = flops / (step_s * DATASHEET_TFLOPS * 1e12) if step_s else None
    if nominal:
        out["mfu_nominal"] = 12 * nominal * tokens / (step_s * DATASHEET_TFLOPS * 1e12)
    for key in ("peak_allocated_gib", "peak_reserved_gib", "wall_s", "device_name", "trace"):
        if key in raw:
            out[key] = raw[key]
    return out


def run_cell(args: argparse.Namespace, work: Path, backend: str, mode: str, shape: str,
             variant: str, extra: list[str]) -> dict[str, Any]:
    name = f"{shape}-{backend}-{mode}-{variant}"
    cell_dir = work / name
    cell_dir.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_shape_model(shape, work / f"model-{shape}")
    spec = {"config": args.config, "model_dir": str(model_dir),
            "trace_step": args.skip if args.trace else None,
            "overrides": cell_overrides(args, backend, mode, shape, model_dir,
                                        cell_dir / "run", extra)}
    (cell_dir / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "palaestra.benchmarks.perf.loop", "--child",
           str(cell_dir / "spec.json")]
    print(f"== {name}: palaestra train {args.config} {shlex.join(spec['overrides'])}", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, timeout=args.cell_timeout, check=False)
    cell: dict[str, Any] = {"name": name, "shape": shape, "backend": backend, "mode": mode,
                            "variant": variant, "overrides": spec["overrides"],
                            "returncode": proc.returncode,
                            "cell_wall_s": time.perf_counter() - start}
    result_file = cell_dir / "result.json"
    if not args.keep_runs:  # checkpoints of a 1.7B cell are ~25 GB: a matrix fills a disk
        shutil.rmtree(cell_dir / "run", ignore_errors=True)
    if proc.returncode != 0 or not result_file.exists():
        print(f"   {name} FAILED (exit {proc.returncode})", flush=True)
        return cell
    raw = json.loads(result_file.read_text())
    cell["raw_steps"] = raw["steps"]
    cell.update(summarize(raw, args.skip, NOMINAL_PARAMS.get(shape)))
    print("   " + row(cell), flush=True)
    return cell


def _f(v: Any, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


HEADER = ("| shape | params | backend | mode | variant | step s | rollout s | logprobs s | train s | "
          "sync s | idle GPU s | engine decode / prefill / host s | decode calls | tokens/s | "
          "MFU | MFU (nominal N) | micro-batches | parked | peak GiB |\n"
          "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def row(c: dict[str, Any]) -> str:
    if c.get("step_s") is None:
        return f"| {c['shape']} | - | {c['backend']} | {c['mode']} | {c['variant']} | failed |"
    pct = (lambda v: "-" if v is None else f"{100 * v:.1f}%")
    n = c.get("params")
    params = "-" if not n else f"{n / 1e6:.0f}M" if n >= 1e7 else f"{n / 1e6:.2f}M"
    return (f"| {c['shape']} | {params} | {c['backend']} | {c['mode']} | {c['variant']} | "
            f"{_f(c['step_s'])} | {_f(c['rollout_s'])} | {_f(c['logprobs_s'])} | "
            f"{_f(c['train_s'])} | {_f(c['weight_sync_s'], 3)} | {_f(c['idle_gpu_s'])} | "
            f"{_f(c.get('engine_decode_s'))} / {_f(c.get('engine_prefill_s'))} / "
            f"{_f(c.get('engine_host_s'))} | {_f(c.get('decode_calls'), 0)} | "
            f"{_f(c['tokens_per_s'], 0)} | {pct(c['mfu'])} | {pct(c.get('mfu_nominal'))} | "
            f"{_f(c['micro_batches'], 0)} | {_f(c['parked'], 0)} | "
            f"{_f(c.get('peak_allocated_gib'), 1)} |")


def trace_rows(cells: list[dict[str, Any]]) -> list[str]:
    """The traced step of each cell (``--trace``): GPU busy/idle, and idle seconds by cause."""
    from palaestra.trace_ranges import CAUSES

    names = [*CAUSES, "other"]
    lines = ["| cell | traced step s | GPU busy s | idle s | " + " | ".join(names) + " |",
             "|---|---:|---:|---:|" + "---:|" * len(names)]
    for c in cells:
        t = c.get("trace")
        if not t:
            continue
        by = t["idle_by_cause_s"]
        lines.append(f"| {c['name']} | {t['step_s']:.3f} | {t['gpu_busy_s']:.3f} | "
                     f"{t['gpu_idle_s']:.3f} | " + " | ".join(f"{by[n]:.3f}" for n in names)
                     + " |")
    return lines if len(lines) > 2 else []


def verdicts(cells: list[dict[str, Any]]) -> list[str]:
    """Async vs sync per (shape, backend, variant): does overlap pay on this device?"""
    lines = []
    by = {(c["shape"], c["backend"], c["variant"], c["mode"]): c for c in cells
          if c.get("step_s")}
    for (shape, backend, variant, mode), c in sorted(by.items()):
        if mode != "async" or (shape, backend, variant, "sync") not in by:
            continue
        speedup = by[(shape, backend, variant, "sync")]["step_s"] / c["step_s"]
        c["async_speedup"] = speedup
        advice = "overlap pays" if speedup >= 1.15 else (
            "overlap does not pay on one device: put the engine and the trainer on separate "
            "GPUs (disaggregated layout, engine.kind = 'sglang' or `palaestra serve`)")
        lines.append(f"{shape} {backend} {variant}: async {speedup:.3f}x sync: {advice}")
    return lines


def parse_variants(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    variants = [("default", shlex.split(args.extra))] if not args.variant or args.extra else []
    for item in args.variant:
        name, _, overrides = item.partition("=")
        variants.append((name, shlex.split(args.extra) + shlex.split(overrides)))
    return variants


def write_json(args: argparse.Namespace, cells: list[dict[str, Any]], lines: list[str]) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"args": vars(args), "cells": cells, "verdicts": lines}, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--config", default="configs/quickstart.toml")
    p.add_argument("--shapes", default=None, help="model shapes (GPU qwen3-0.6b, CPU tiny)")
    p.add_argument("--backends", default=None, help="torch,megatron (CPU: torch)")
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--steps", type=int, default=None, help="RL steps per cell (GPU 5, CPU 2)")
    p.add_argument("--skip", type=int, default=1, help="leading steps left out of the means")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--extra", default="", help="overrides added to every cell")
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=OVERRIDES: also run every cell with these overrides")
    p.add_argument("--work-dir", default=None, help="run directories (default: a temp dir)")
    p.add_argument("--cell-timeout", type=float, default=1800.0)
    p.add_argument("--keep-runs", action="store_true",
                   help="keep each cell's run directory (checkpoints, exported model)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--trace", action="store_true",
                   help="profile the first steady step (step --skip) of every cell: a "
                   "torch.profiler trace beside the cell and its idle time by cause")
    args = p.parse_args(argv)
    if args.child:
        return child(Path(args.child))
    gpu = args.device == "cuda"
    args.steps = args.steps or (5 if gpu else 2)
    shapes = (args.shapes or ("qwen3-0.6b" if gpu else "tiny")).split(",")
    backends = (args.backends or ("torch,megatron" if gpu else "torch")).split(",")
    modes = args.modes.split(",")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="palaestra-loop-"))
    cells: list[dict[str, Any]] = []
    for shape in shapes:
        for name, extra in parse_variants(args):
            for backend in backends:
                for mode in modes:
                    cells.append(run_cell(args, work, backend, mode, shape, name, extra))
                    write_json(args, cells, verdicts(cells))  # a killed run keeps its cells
    lines = verdicts(cells)
    print("\n" + HEADER)
    for c in cells:
        print(row(c))
    traced = trace_rows(cells)
    if traced:
        print("\nGPU idle seconds of the traced step by cause (host seconds without a GPU):")
        print("\n".join(traced))
    for line in lines:
        print(line)
    write_json(args, cells, lines)
    return 0 if all(c["returncode"] == 0 for c in cells) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Sandbox throughput and latency: warm pool (LocalSandbox) vs a cold ``python -S -I`` baseline.

Run:  python benchmarks/perf/sandbox.py --json /tmp/sandbox_bench.json   (about 1-2 minutes)

Both sides run with isolation on (network and filesystem): the warm pool is the default
LocalSandbox (bubblewrap + per-run uid + Landlock + seccomp + rlimits); the cold baseline starts
``bwrap <same read-only binds, no network> python -S -I -c CODE`` for every execution. For each
program (trivial, 200 ms of CPU) and concurrency (1, 2, 8, 32) the two are measured back to back
and reported side by side: executions per second, p50/p99 end-to-end latency, failures. The
machine's load average is recorded too: on a shared box it moves the numbers a lot.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

PROGRAMS = {
    "trivial": "print(1)",
    "cpu200ms": ("import time\nt = time.process_time()\n"
                 "while time.process_time() - t < 0.2:\n    pass\nprint(1)"),
}
CONCURRENCY = (1, 2, 8, 32)


def _plan(program: str, conc: int, quick: bool) -> tuple[int, float]:
    """(max executions, time budget in seconds) for one cell of the table."""
    if program == "trivial":
        return (100 if quick else 400), (1.5 if quick else 4.0)
    return max(2 * conc, 8 if quick else 16), (6.0 if quick else 15.0)


async def drive_concurrently(one: Callable[[], Awaitable[bool]], conc: int, n_max: int,
                             budget_s: float) -> tuple[list[float], float, int]:
    """Run ``one`` with ``conc`` in flight until n_max executions or the time budget:
    (latencies in s, elapsed s, failures)."""
    lat: list[float] = []
    failures = 0
    started = 0
    t0 = time.perf_counter()

    async def worker() -> None:
        nonlocal started, failures
        while started < n_max and time.perf_counter() - t0 < budget_s:
            started += 1
            t = time.perf_counter()
            ok = await one()
            lat.append(time.perf_counter() - t)
            failures += not ok

    await asyncio.gather(*(worker() for _ in range(conc)))
    return lat, time.perf_counter() - t0, failures


async def _drive(one: Callable[[], Awaitable[bool]], conc: int, n_max: int,
                 budget_s: float) -> dict[str, Any]:
    """`drive_concurrently`, summarised: throughput, p50/p99/mean latency, failures."""
    lat, elapsed, failures = await drive_concurrently(one, conc, n_max, budget_s)
    lat.sort()
    return {"n": len(lat), "per_s": len(lat) / elapsed if elapsed else 0.0,
            "p50_ms": 1e3 * lat[len(lat) // 2] if lat else None,
            "p99_ms": 1e3 * lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None,
            "mean_ms": 1e3 * statistics.fmean(lat) if lat else None, "failures": failures}


class ColdBaseline:
    """``bwrap ... python -S -I -c CODE`` per execution, same visibility as the warm pool."""

    def __init__(self) -> None:
        from palaestra.sandbox.isolation import bwrap_argv, clean_env, python_layout
        from palaestra.sandbox.probe import probe_isolation

        report = probe_isolation()
        layout = python_layout()
        self.python = layout.executable
        self.env = clean_env()
        if report.bwrap:
            self.prefix = bwrap_argv(report.bwrap, layout, "/sandbox", chdir="/sandbox")
            self.isolation = "bwrap (no network, read-only system, private tmpfs workdir)"
        elif report.unshare:
            self.prefix = ["unshare", "--net", "--"]
            self.isolation = "unshare --net"
        else:
            self.prefix = []
            self.isolation = "none available"

    async def run(self, code: str) -> bool:
        proc = await asyncio.create_subprocess_exec(
            *self.prefix, self.python, "-S", "-I", "-c", code, env=self.env,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        out, _ = await proc.communicate()
        return proc.returncode == 0 and out == b"1\n"


async def bench(quick: bool) -> dict[str, Any]:
    from palaestra.sandbox import Sandbox

    cold = ColdBaseline()
    results: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    async with Sandbox(max_concurrency=64) as sb:  # type: ignore[abstract]  # __new__ picks the backend
        for _ in range(20):  # warm-up
            await sb.run("pass")

        async def warm(code: str) -> bool:
            res = await sb.run(code, timeout=30)
            return res.ok and res.stdout == "1\n"

        for program, code in PROGRAMS.items():
            for conc in CONCURRENCY:
                n_max, budget = _plan(program, conc, quick)
                for mode, fn in (("warm", warm), ("cold", cold.run)):
                    stats = await _drive(functools.partial(fn, code), conc, n_max, budget)
                    stats.update(mode=mode, program=program, concurrency=conc,
                                 load1=os.getloadavg()[0])
                    results.append(stats)
                    print(f"  {program:9s} c={conc:<3d} {mode:5s} {stats['per_s']:8.1f}/s  "
                          f"p50 {stats['p50_ms']:8.2f} ms  p99 {stats['p99_ms']:8.2f} ms  "
                          f"fail {stats['failures']}", file=sys.stderr)
        mode_info = dict(sb.mode)  # type: ignore[attr-defined]
        workers = len(sb._workers)  # type: ignore[attr-defined]
    return {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(),
                        "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
            "warm_isolation": mode_info, "warm_workers": workers,
            "cold_isolation": cold.isolation, "results": results,
            "target": {"trivial_c8_per_s": 500, "trivial_c1_p50_ms": 5.0}}


def table(report: dict[str, Any]) -> str:
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for r in report["results"]:
        rows.setdefault((r["program"], r["concurrency"]), {})[r["mode"]] = r
    head = (f"{'program':9s} {'conc':>4s} | {'warm/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s} | "
            f"{'cold/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s} | {'speedup':>7s}")
    lines = [head, "-" * len(head)]
    for (program, conc), cell in rows.items():
        w, c = cell["warm"], cell["cold"]
        lines.append(f"{program:9s} {conc:4d} | {w['per_s']:8.1f} {w['p50_ms']:8.2f} "
                     f"{w['p99_ms']:8.2f} | {c['per_s']:8.1f} {c['p50_ms']:8.2f} "
                     f"{c['p99_ms']:8.2f} | {w['per_s'] / max(c['per_s'], 1e-9):6.1f}x")
    m = report["machine"]
    lines.append(f"machine: {m['cpus']} CPUs, load average before {m['loadavg_before'][0]:.1f}, "
                 f"after {m['loadavg_after'][0]:.1f}")
    lines.append(f"warm: {report['warm_workers']} zygote(s), {report['warm_isolation']}")
    lines.append(f"cold: {report['cold_isolation']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=str, default=None, help="write the full report here")
    parser.add_argument("--quick", action="store_true", help="fewer executions per cell")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report = asyncio.run(bench(args.quick))
    print(table(report))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

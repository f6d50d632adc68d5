"""Sandbox hot path: trivial runs/s and latency at concurrency 1 and 8, and session fork latency.

Run:  python benchmarks/perf/sandbox_fork.py --json /tmp/sandbox_fork.json   (about 20 s)

The sandbox is the default ``LocalSandbox`` with every layer in force (bubblewrap, per-run uid
as root, a pid namespace and a hidepid /proc per run, tmpfs workspace, rlimits, Landlock,
seccomp); ``mode`` in the JSON says which layers the sandbox reports. Rows:

* ``run c=1`` / ``run c=8``: ``sandbox.run("print(1)")`` with 1 or 8 in flight (targets:
  >= 500/s at c=8, p50 <= 5 ms);
* ``fork``: ``session.fork()`` of a persistent-python session holding a variable and a file
  (target p50 <= 10 ms), each fork checked (it sees the variable) and closed after.

The machine's load average is recorded before and after: on a shared box it moves the numbers.
So each run row also reports ``cpu_ms``: CPU time per run of the host process plus every process
of the sandbox (zygotes and, through their reaped children, every run), which a busy machine
moves much less than throughput. ``--repeat N`` measures every row N times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any


def _stats(lat: list[float], elapsed: float, failures: int) -> dict[str, Any]:
    lat = sorted(lat)
    n = len(lat)
    return {"n": n, "per_s": n / elapsed if elapsed else 0.0,
            "p50_ms": 1e3 * lat[n // 2] if lat else None,
            "p90_ms": 1e3 * lat[min(n - 1, int(n * 0.9))] if lat else None,
            "p99_ms": 1e3 * lat[min(n - 1, int(n * 0.99))] if lat else None,
            "failures": failures}


def _tree_cpu_s(roots: list[int]) -> float:
    """CPU seconds of the processes below ``roots`` (their own and their reaped children's)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, stack = 0, list(roots)
    while stack:
        pid = stack.pop()
        try:
            stat = open(f"/proc/{pid}/stat").read()
            fields = stat[stat.rindex(")") + 2:].split()
            total += sum(int(x) for x in fields[11:15])
            with open(f"/proc/{pid}/task/{pid}/children") as fh:
                stack.extend(int(x) for x in fh.read().split())
        except (OSError, ValueError):
            continue
    return total / tick


def _cpu_now(sb: Any) -> float:
    roots = [w._proc.pid for w in getattr(sb, "_workers", []) if w is not None]
    times = os.times()
    return times.user + times.system + _tree_cpu_s(roots)


async def _drive(one: Callable[[], Awaitable[bool]], conc: int, n_max: int,
                 budget_s: float) -> dict[str, Any]:
    from palaestra.benchmarks.perf.sandbox import drive_concurrently

    return _stats(*await drive_concurrently(one, conc, n_max, budget_s))


async def _fork_row(sb: Any, n: int) -> dict[str, Any]:
    """``n`` forks, 10 per parent session (each fork adds a Landlock layer to its parent)."""
    lat: list[float] = []
    failures = 0
    t0 = time.perf_counter()
    while len(lat) < n:
        async with sb.session(persistent_python=True) as parent:
            await parent.run("x = 41\nopen('f.txt', 'w').write('hi')")
            for _ in range(min(10, n - len(lat))):
                t = time.perf_counter()
                child = await parent.fork()
                lat.append(time.perf_counter() - t)
                res = await child.run("print(x + 1, open('f.txt').read())")
                failures += res.stdout != "42 hi\n"
                await child.close()
    return _stats(lat, time.perf_counter() - t0, failures)


async def bench(repeat: int, quick: bool) -> dict[str, Any]:
    from palaestra.sandbox import Sandbox

    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    n_runs = 300 if quick else 1500
    async with Sandbox(max_concurrency=64) as sb:  # type: ignore[abstract]  # __new__ picks the backend
        for _ in range(30):
            await sb.run("pass")

        async def trivial() -> bool:
            res = await sb.run("print(1)", timeout=30)
            return res.ok and res.stdout == "1\n"

        can_fork = hasattr(sb.session(), "fork")
        for rep in range(repeat):
            for conc in (1, 8):
                cpu0 = _cpu_now(sb)
                stats = await _drive(trivial, conc, n_runs, 3.0 if quick else 8.0)
                cpu_ms = 1e3 * (_cpu_now(sb) - cpu0) / max(stats["n"], 1)
                stats.update(row=f"run c={conc}", repeat=rep, load1=os.getloadavg()[0],
                             cpu_ms=cpu_ms)
                rows.append(stats)
                print(f"  run c={conc:<2d} {stats['per_s']:7.1f}/s  p50 {stats['p50_ms']:6.2f} ms"
                      f"  p99 {stats['p99_ms']:6.2f} ms  cpu {cpu_ms:5.2f} ms/run"
                      f"  fail {stats['failures']}", file=sys.stderr)
            if can_fork:
                stats = await _fork_row(sb, 20 if quick else 60)
                stats.update(row="fork", repeat=rep, load1=os.getloadavg()[0])
                rows.append(stats)
                print(f"  fork     p50 {stats['p50_ms']:6.2f} ms  p99 {stats['p99_ms']:6.2f} ms"
                      f"  fail {stats['failures']}", file=sys.stderr)
        mode = dict(sb.mode)  # type: ignore[attr-defined]
    return {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(), "loadavg_before": load_before,
                        "loadavg_after": os.getloadavg()},
            "mode": mode, "rows": rows,
            "target": {"run_c8_per_s": 500, "run_p50_ms": 5.0, "fork_p50_ms": 10.0}}


def table(report: dict[str, Any]) -> str:
    head = f"{'row':8s} {'rep':>3s} | {'per_s':>8s} {'p50 ms':>7s} {'p90 ms':>7s} {'p99 ms':>7s} " \
           f"{'cpu ms':>6s} {'fail':>4s} {'load1':>5s}"
    lines = [head, "-" * len(head)]
    for r in report["rows"]:
        cpu = f"{r['cpu_ms']:6.2f}" if "cpu_ms" in r else f"{'-':>6s}"
        lines.append(f"{r['row']:8s} {r['repeat']:3d} | {r['per_s']:8.1f} {r['p50_ms']:7.2f} "
                     f"{r['p90_ms']:7.2f} {r['p99_ms']:7.2f} {cpu} {r['failures']:4d} "
                     f"{r['load1']:5.1f}")
    m = report["machine"]
    lines.append(f"machine: {m['cpus']} CPUs, load average before {m['loadavg_before'][0]:.1f}, "
                 f"after {m['loadavg_after'][0]:.1f}")
    lines.append(f"mode: {report['mode']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=str, default=None, help="write the full report here")
    parser.add_argument("--repeat", type=int, default=2, help="measure every row this often")
    parser.add_argument("--quick", action="store_true", help="fewer executions per row")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report = asyncio.run(bench(args.repeat, args.quick))
    print(table(report))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

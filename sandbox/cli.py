"""``palaestra sandbox doctor|run``: report the isolation in force, run a file in the sandbox.

``doctor`` probes every layer, then starts a real sandbox and checks the guarantees live
(network blocked, writes outside the workspace refused, host environment invisible); with
``--docker`` it does the same for the Docker backend. ``run FILE`` executes a program and prints
its output and exit status. Nothing heavy is imported until a subcommand runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

#: code run by ``doctor`` inside the sandbox; prints one JSON line of observations
_CHECK = r"""
import json, os, socket
obs = {}
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1); obs["network"] = "OPEN"
except OSError as e:
    obs["network"] = "blocked (%s)" % e.strerror
try:
    open("/tmp/palaestra-doctor-probe", "w"); obs["write_outside"] = "ALLOWED"
except OSError as e:
    obs["write_outside"] = "blocked (%s)" % e.strerror
obs["host_env_visible"] = "PALAESTRA_DOCTOR_SECRET" in os.environ
obs["uid"] = os.getuid()
obs["pid"] = os.getpid()
obs["visible_pids"] = len([p for p in os.listdir("/proc") if p.isdigit()])
ppid = os.getppid()
if ppid == 0:  # the parent lives outside the run's pid namespace: it has no pid here
    obs["signal_parent"] = "blocked (no parent in the run's pid namespace)"
else:
    try:
        os.kill(ppid, 0); obs["signal_parent"] = "ALLOWED"
    except OSError as e:
        obs["signal_parent"] = "blocked (%s)" % e.strerror
print(json.dumps(obs))
"""


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    doc = sub.add_parser("doctor", help="probe isolation layers and verify them live")
    doc.add_argument("--docker", action="store_true", help="also check the Docker backend")
    doc.add_argument("--json", action="store_true", help="print a JSON report")
    run = sub.add_parser("run", help="run a file in the sandbox and print its output")
    run.add_argument("file", type=Path, help="program to run ('-' for stdin)")
    run.add_argument("--language", default=None, help="python (default for .py), bash or sh")
    run.add_argument("--backend", default="local", choices=["local", "docker"])
    run.add_argument("--timeout", type=float, default=5.0)
    run.add_argument("--stdin", type=Path, default=None, help="file fed to the program's stdin")
    run.add_argument("--memory-mb", type=int, default=512)


def run(args: argparse.Namespace) -> int:
    if args.action == "doctor":
        return asyncio.run(_doctor(args.docker, args.json))
    return asyncio.run(_run_file(args))


async def _live_check(backend: str) -> dict[str, Any]:
    from palaestra.sandbox import Sandbox

    os.environ["PALAESTRA_DOCTOR_SECRET"] = "x"
    try:
        t0 = time.perf_counter()
        async with Sandbox(backend=backend) as sb:  # type: ignore[abstract]  # __new__ picks the backend
            started = time.perf_counter() - t0
            res = await sb.run(_CHECK, timeout=10)
            lat = []
            for _ in range(5):
                t = time.perf_counter()
                await sb.run("pass")
                lat.append(time.perf_counter() - t)
            info: dict[str, Any] = {"ok": res.ok, "start_s": round(started, 3),
                                    "run_ms": round(sorted(lat)[2] * 1e3, 2)}
            if hasattr(sb, "mode"):
                info["mode"] = sb.mode
            if res.ok:
                info.update(json.loads(res.stdout.strip().splitlines()[-1]))
            else:
                info["error"] = res.error or res.stderr[-500:]
            return info
    except Exception as exc:  # doctor reports, it does not crash
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        os.environ.pop("PALAESTRA_DOCTOR_SECRET", None)


async def _doctor(docker: bool, as_json: bool) -> int:
    from palaestra.sandbox.probe import describe_mode, probe_isolation

    report = probe_isolation()
    local = await _live_check("local")
    out: dict[str, Any] = {"probe": {"root": report.root, "bwrap": report.bwrap,
                                     "unshare": report.unshare,
                                     "landlock_abi": report.landlock_abi,
                                     "seccomp": report.seccomp,
                                     "network_isolation": report.network_isolation,
                                     "notes": list(report.notes)},
                           "local": local}
    if docker:
        out["docker"] = await _live_check("docker")
    if as_json:
        print(json.dumps(out, indent=2))
    else:
        print(report.format())
        for name in ("local", "docker"):
            if name not in out:
                continue
            info = out[name]
            print(f"\n{name} sandbox live check: {'OK' if info.get('ok') else 'FAILED'}")
            if name == "local" and "mode" in info:
                print("  layers in force (live):")
                for line in describe_mode(info["mode"]):
                    print(f"    - {line}")
            for key in ("mode", "start_s", "run_ms", "network", "write_outside",
                        "host_env_visible", "uid", "pid", "visible_pids", "signal_parent",
                        "error"):
                if key in info and not (name == "local" and key == "mode"):
                    print(f"  {key:17s} {info[key]}")
    ok = bool(local.get("ok")) and local.get("network", "").startswith("blocked") \
        and local.get("write_outside", "").startswith("blocked") \
        and not local.get("host_env_visible", True) \
        and local.get("signal_parent", "").startswith("blocked")
    if docker:
        ok = ok and bool(out["docker"].get("ok"))
    return 0 if ok else 1


async def _run_file(args: argparse.Namespace) -> int:
    from palaestra.sandbox import Sandbox

    code = sys.stdin.read() if str(args.file) == "-" else args.file.read_text()
    language = args.language or ("python" if str(args.file).endswith(".py") or
                                 str(args.file) == "-" else "bash")
    stdin = args.stdin.read_bytes() if args.stdin else None
    async with Sandbox(backend=args.backend, memory_mb=args.memory_mb) as sb:  # type: ignore[abstract]  # __new__ picks the backend
        res = await sb.run(code, language=language, timeout=args.timeout, stdin=stdin)
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr)
    print(f"[{res.summary()}, {res.duration_s * 1e3:.1f} ms]", file=sys.stderr)
    return res.exit_code if 0 <= res.exit_code < 256 else 1

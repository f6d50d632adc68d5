"""Load on `palaestra serve`: concurrent good and bad requests, a /health probe, the server's RSS.

From the repository root (CPU, the tiny local model; no downloads)::

    python -m palaestra.benchmarks.perf.serve_load --requests 500 --json serve_load.json

Builds the tiny model (``palaestra init-model``) unless ``--model`` names one, starts ``palaestra
serve`` on a free loopback port with an API key and an admin key, computes each good request's
greedy answer alone (the reference), then fires ``--requests`` requests at once, mixed: good
``/generate`` (token ids, checked token for token against the reference), chat and legacy
completions (OpenAI schema, token counts), n > 1 and streams (``[DONE]``), and bad ones from the
review of issue 18 (huge, negative and mistyped ``n``; wrong types; ids outside the vocabulary;
an oversized body (``--big-body-mb``); missing, wrong and non-admin keys; an unknown model), each expecting its 4xx.
Meanwhile a separate process (so the client's own load is not measured) GETs ``/health`` every
20 ms. Checks: every good answer correct, every bad one its 4xx, ``/health`` never slower than
``--health-bound-ms``, and the server's RSS after the load within ``--rss-bound-mb`` of its RSS
before it. Exit code 1 when a check fails. Everything is bounded: ``--timeout-s`` for the whole
load, one client session, loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KEY, ADMIN = "bench-user-key", "bench-admin-key"
MSGS = [{"role": "user", "content": "Say something."}]


@dataclass
class Case:
    """One request of the mix: what is sent, what must come back."""

    kind: str
    path: str
    body: Any
    expect: int
    key: str | None = KEY
    check: Any = None  # fn(response json) -> str | None (a problem)
    raw: bytes | None = None
    stream: bool = False
    latency_s: float = 0.0
    status: int = 0
    problem: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _probe(url: str, out: str, stop: str, interval_s: float) -> int:
    """The /health prober (its own process): one keep-alive connection, latencies to ``out``."""
    import http.client
    from urllib.parse import urlparse

    u = urlparse(url)
    host = u.hostname or "127.0.0.1"  # the server's URL always names its host
    conn = http.client.HTTPConnection(host, u.port, timeout=10)
    lat: list[float] = []
    when: list[float] = []
    failures = 0
    while not os.path.exists(stop):
        when.append(time.time())
        t = time.perf_counter()
        try:
            conn.request("GET", "/health")
            resp = conn.getresponse()
            resp.read()
            if resp.status != 200:
                failures += 1
        except OSError:
            failures += 1
            conn.close()
            conn = http.client.HTTPConnection(host, u.port, timeout=10)
        lat.append(time.perf_counter() - t)
        time.sleep(interval_s)
    Path(out).write_text(json.dumps({"latency_s": lat, "at": when, "failures": failures}))
    return 0


def _gen_check(expected: list[int]) -> Any:
    def check(out: Any) -> str | None:
        if out.get("output_ids") != expected:
            return f"output_ids {out.get('output_ids')} != reference {expected}"
        if out["meta_info"]["finish_reason"]["type"] != "length":
            return f"finish_reason {out['meta_info']['finish_reason']}"
        return None
    return check


def _chat_check(n: int, tokens: int, expected: str | None = None) -> Any:
    def check(out: Any) -> str | None:
        if out.get("object") != "chat.completion" or len(out.get("choices", ())) != n:
            return f"not {n} chat choices: {str(out)[:200]}"
        if out["usage"]["completion_tokens"] != n * tokens:
            return f"completion_tokens {out['usage']['completion_tokens']} != {n * tokens}"
        if expected is not None and out["choices"][0]["message"]["content"] != expected:
            return "content differs from the reference"
        return None
    return check


def _completion_check(expected: str) -> Any:
    def check(out: Any) -> str | None:
        if out.get("object") != "text_completion" or out["choices"][0]["text"] != expected:
            return f"completion text differs from the reference: {str(out)[:200]}"
        return None
    return check


def _bad_cases(big: bytes, big_mb: float) -> list[Case]:
    gen, chat, cmpl = "/generate", "/v1/chat/completions", "/v1/completions"
    ids = [5, 6, 7]
    c = [
        Case("bad: chat n=1e9", chat, {"messages": MSGS, "n": 10**9}, 400),
        Case("bad: chat n=2000", chat, {"messages": MSGS, "n": 2000}, 400),
        Case("bad: chat n=-1", chat, {"messages": MSGS, "n": -1}, 400),
        Case("bad: chat n=0", chat, {"messages": MSGS, "n": 0}, 400),
        Case("bad: chat max_tokens=0", chat, {"messages": MSGS, "max_tokens": 0}, 400),
        Case("bad: generate n=1e9", gen, {"input_ids": ids, "sampling_params": {"n": 10**9}}, 400),
        Case("bad: generate n=-1", gen, {"input_ids": ids, "sampling_params": {"n": -1}}, 400),
        Case("bad: stop_token_ids ['x']", gen,
             {"input_ids": ids, "sampling_params": {"stop_token_ids": ["x"]}}, 400),
        Case("bad: logit_bias id 100000", gen,
             {"input_ids": ids, "sampling_params": {"logit_bias": {"100000": 1.0}}}, 400),
        Case(f"bad: {big_mb:g} MB body", gen, None, 413, raw=big),
        Case("bad: no key", gen, {"input_ids": ids}, 401, key=None),
        Case("bad: wrong key", chat, {"messages": MSGS}, 401, key="wrong"),
        Case("bad: weights with user key", "/update_weights_from_disk",
             {"model_path": "/tmp/elsewhere"}, 403),
        Case("bad: unknown model", chat, {"model": "gpt-4o", "messages": MSGS}, 404),
        Case("bad: completions unknown model", cmpl, {"model": "davinci", "prompt": "x"}, 404),
    ]
    for field_, value in (("n", "abc"), ("temperature", "hot"), ("stop", 5), ("tools", "x"),
                          ("logit_bias", {"a": 1}), ("seed", "x"), ("max_tokens", "5"),
                          ("max_tokens", 2.7)):
        c.append(Case(f"bad: chat {field_}={value!r}"[:40], chat,
                      {"messages": MSGS, field_: value}, 400))
    return c


async def _send(session: Any, url: str, case: Case, delay_s: float = 0.0) -> None:
    if delay_s:
        await asyncio.sleep(delay_s)
    headers = {"Authorization": f"Bearer {case.key}"} if case.key else {}
    kw: dict[str, Any] = {"headers": headers}
    if case.raw is not None:
        kw["data"] = case.raw
        headers["Content-Type"] = "application/json"
    else:
        kw["json"] = case.body
    t = time.perf_counter()
    try:
        async with session.post(url + case.path, **kw) as r:
            case.status = r.status
            text = await r.text()
    except Exception as exc:  # noqa: BLE001 - a failed request is a result here
        case.latency_s = time.perf_counter() - t
        case.problem = f"{type(exc).__name__}: {exc}"
        return
    case.latency_s = time.perf_counter() - t
    if case.status != case.expect:
        case.problem = f"status {case.status} != {case.expect}: {text[:200]}"
        return
    if case.stream:
        events = [e for e in text.strip().split("\n\n") if e]
        if not events or events[-1] != "data: [DONE]":
            case.problem = "stream did not end with [DONE]"
        elif any('"error"' in e for e in events):
            case.problem = "stream carried an error event"
        return
    out: Any = json.loads(text) if text else None
    if case.expect >= 400:
        shape_ok = (set(out) == {"error"} and {"message", "type", "param", "code"} <=
                    set(out["error"])) if case.path.startswith("/v1/") else (
            isinstance(out, dict) and out.get("object") == "error")
        if not shape_ok:
            case.problem = f"error body not in the route's shape: {text[:200]}"
    elif case.check is not None:
        case.problem = case.check(out)


async def _load(url: str, args: argparse.Namespace, pid: int) -> dict[str, Any]:
    import aiohttp

    rng = random.Random(args.seed)
    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        # the references: each distinct good prompt answered alone, greedily
        prompts = [[rng.randrange(10, 700) for _ in range(rng.randrange(4, 24))]
                   for _ in range(16)]
        tokens = args.new_tokens
        refs = []
        for p in prompts:
            async with session.post(url + "/generate", headers={"Authorization": f"Bearer {KEY}"},
                                    json={"input_ids": p, "sampling_params": {
                                        "max_new_tokens": tokens, "temperature": 0,
                                        "ignore_eos": True}}) as r:
                refs.append((await r.json())["output_ids"])
        h = {"Authorization": f"Bearer {KEY}"}
        chat_body = {"model": "tiny", "messages": MSGS, "max_tokens": tokens, "temperature": 0,
                     "ignore_eos": True}
        async with session.post(url + "/v1/chat/completions", headers=h, json=chat_body) as r:
            chat_ref = (await r.json())["choices"][0]["message"]["content"]
        cmpl_body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": tokens,
                     "temperature": 0, "ignore_eos": True}
        async with session.post(url + "/v1/completions", headers=h, json=cmpl_body) as r:
            cmpl_ref = (await r.json())["choices"][0]["text"]
        big = b'{"text": "' + b"a" * int(args.big_body_mb * (1 << 20)) + b'"}'
        bad = _bad_cases(big, args.big_body_mb)
        cases: list[Case] = []
        for i in range(args.requests):
            if rng.random() < args.bad_fraction:
                b = bad[i % len(bad)]
                cases.append(Case(b.kind, b.path, b.body, b.expect, b.key, raw=b.raw))
                continue
            pick = rng.random()
            if pick < 0.45:
                j = rng.randrange(len(prompts))
                cases.append(Case("good: /generate ids", "/generate", {
                    "input_ids": prompts[j], "sampling_params": {
                        "max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}},
                    200, check=_gen_check(refs[j])))
            elif pick < 0.65:
                cases.append(Case("good: chat", "/v1/chat/completions", chat_body, 200,
                                  check=_chat_check(1, tokens, chat_ref)))
            elif pick < 0.75:
                cases.append(Case("good: chat n=4 sampled", "/v1/chat/completions",
                                  {**chat_body, "n": 4, "temperature": 1.0}, 200,
                                  check=_chat_check(4, tokens)))
            elif pick < 0.9:
                cases.append(Case("good: completions", "/v1/completions", cmpl_body, 200,
                                  check=_completion_check(cmpl_ref)))
            else:
                cases.append(Case("good: chat stream", "/v1/chat/completions",
                                  {**chat_body, "stream": True}, 200, stream=True))
        rss_before = _rss_mb(pid)
        peak = [rss_before]

        async def sample_rss() -> None:
            while True:
                peak.append(_rss_mb(pid))
                await asyncio.sleep(0.1)

        sampler = asyncio.create_task(sample_rss())
        started = time.time()
        t0 = time.perf_counter()
        step = args.ramp_s / max(len(cases), 1)
        await asyncio.wait_for(asyncio.gather(*(
            _send(session, url, c, i * step) for i, c in enumerate(cases))), args.timeout_s)
        wall = time.perf_counter() - t0
        sampler.cancel()
    await asyncio.sleep(args.settle_s)
    return {"cases": cases, "wall_s": wall, "started": started, "rss_before_mb": rss_before,
            "rss_peak_mb": max(peak), "rss_after_mb": _rss_mb(pid)}


def _summarise(cases: list[Case]) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for c in cases:
        row = rows.setdefault(c.kind, {"kind": c.kind, "count": 0, "ok": 0, "statuses": {},
                                       "latencies": [], "problems": []})
        row["count"] += 1
        row["ok"] += c.problem is None
        row["statuses"][c.status] = row["statuses"].get(c.status, 0) + 1
        row["latencies"].append(c.latency_s)
        if c.problem and len(row["problems"]) < 3:
            row["problems"].append(c.problem)
    out = []
    for row in sorted(rows.values(), key=lambda r: (not r["kind"].startswith("good"), r["kind"])):
        lat = sorted(row.pop("latencies"))
        row["p50_ms"] = 1000 * statistics.median(lat)
        row["max_ms"] = 1000 * lat[-1]
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: build the tiny one)")
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--bad-fraction", type=float, default=0.4)
    p.add_argument("--ramp-s", type=float, default=0.0,
                   help="spread the requests' starts over this long (0: all at once)")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--timeout-s", type=float, default=300.0, help="bound on the whole load")
    p.add_argument("--settle-s", type=float, default=2.0, help="wait before the RSS after")
    p.add_argument("--health-bound-ms", type=float, default=100.0)
    p.add_argument("--rss-bound-mb", type=float, default=300.0,
                   help="allowed growth of the server's RSS from before to after the load")
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    p.add_argument("--big-body-mb", type=float, default=40.0,
                   help="size of the oversized bodies (the server's limit is 32 MB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--probe", nargs=3, metavar=("URL", "OUT", "STOP"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe:
        url, out, stop = args.probe
        return _probe(url, out, stop, interval_s=0.02)

    from palaestra.engines.serve.serve import serve_process

    tmp = Path(tempfile.mkdtemp(prefix="serve-load-"))
    model = args.model
    if model is None:
        model = str(tmp / "tiny")
        subprocess.run([sys.executable, "-m", "palaestra", "init-model", "--out", model],
                       check=True, stdout=subprocess.DEVNULL)
    env = dict(os.environ, PYTHONASYNCIODEBUG="1") if os.environ.get("SERVE_LOAD_DEBUG") else None
    server = serve_process(model, device="cpu", log_path=tmp / "serve.log", env=env, extra=(
        "--threads", str(args.threads), "--max-running", "64", "--api-key", KEY,
        "--admin-api-key", ADMIN))
    stop_file, probe_out = tmp / "stop", tmp / "probe.json"
    prober = None
    try:
        asyncio.run(server.wait_ready(180))
        prober = subprocess.Popen([sys.executable, "-m", "palaestra.benchmarks.perf.serve_load",
                                   "--probe", server.url, str(probe_out), str(stop_file)])
        time.sleep(0.5)
        result = asyncio.run(_load(server.url, args, server.proc.pid))
    finally:
        stop_file.touch()
        if prober is not None:
            prober.wait(30)
        server.stop()
    probe = json.loads(probe_out.read_text())
    print(f"server log: {tmp / 'serve.log'}")
    health = sorted(probe["latency_s"])
    rows = _summarise(result["cases"])
    good = [c for c in result["cases"] if c.kind.startswith("good")]
    bad = [c for c in result["cases"] if not c.kind.startswith("good")]
    summary = {
        "requests": len(result["cases"]), "good": len(good), "bad": len(bad),
        "good_correct": sum(c.problem is None for c in good),
        "bad_4xx_in_shape": sum(c.problem is None for c in bad),
        "wall_s": result["wall_s"], "ramp_s": args.ramp_s,
        "health_probes": len(health), "health_failures": probe["failures"],
        "health_p50_ms": 1000 * statistics.median(health),
        "health_p99_ms": 1000 * health[int(0.99 * (len(health) - 1))],
        "health_max_ms": 1000 * health[-1], "health_bound_ms": args.health_bound_ms,
        "rss_before_mb": result["rss_before_mb"], "rss_peak_mb": result["rss_peak_mb"],
        "rss_after_mb": result["rss_after_mb"], "rss_bound_mb": args.rss_bound_mb,
        "load_average": os.getloadavg(),
    }
    checks = {
        "every good request correct": summary["good_correct"] == len(good),
        "every bad request its 4xx": summary["bad_4xx_in_shape"] == len(bad),
        f"/health max <= {args.health_bound_ms:g} ms": summary["health_max_ms"]
        <= args.health_bound_ms and probe["failures"] == 0,
        f"RSS after <= before + {args.rss_bound_mb:g} MB":
            summary["rss_after_mb"] <= summary["rss_before_mb"] + args.rss_bound_mb,
    }
    print("\n| kind | count | correct | statuses | p50 ms | max ms |")
    print("|---|---:|---:|---|---:|---:|")
    for r in rows:
        statuses = " ".join(f"{k}x{v}" for k, v in sorted(r["statuses"].items()))
        print(f"| {r['kind']} | {r['count']} | {r['ok']} | {statuses} | {r['p50_ms']:.0f} | "
              f"{r['max_ms']:.0f} |")
        for problem in r["problems"]:
            print(f"|   problem: {problem[:150]} | | | | | |")
    start = "at once" if not args.ramp_s else f"started over {args.ramp_s:g} s"
    print(f"\n{summary['requests']} requests {start} ({summary['good']} good, {summary['bad']} "
          f"bad) in {summary['wall_s']:.1f} s; load average {summary['load_average'][0]:.1f}")
    print(f"/health: {summary['health_probes']} probes, p50 {summary['health_p50_ms']:.1f} ms, "
          f"p99 {summary['health_p99_ms']:.1f} ms, max {summary['health_max_ms']:.1f} ms, "
          f"{summary['health_failures']} failures")
    slow = [(round(t - result["started"], 2), round(1000 * lat))
            for t, lat in zip(probe["at"], probe["latency_s"]) if lat > args.health_bound_ms / 1e3]
    summary["health_slow_probes"] = slow
    print(f"/health probes over {args.health_bound_ms:g} ms (s after the load started, ms): "
          f"{slow}")
    print(f"server RSS: before {summary['rss_before_mb']:.0f} MB, peak "
          f"{summary['rss_peak_mb']:.0f} MB, after {summary['rss_after_mb']:.0f} MB (bound: "
          f"before + {args.rss_bound_mb:g} MB)")
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {name}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"summary": summary, "checks": checks, "rows": rows}, indent=2, default=str))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Episode throughput of the two routers over the same two ``palaestra serve`` CPU workers.

From the repository root (CPU; no downloads)::

    python -m palaestra.benchmarks.perf.router_throughput --episodes 256 --json router.json
    python -m palaestra.benchmarks.perf.router_throughput --model runs/quickstart/final-model

Starts two ``palaestra serve --device cpu --threads 1`` workers on free loopback ports, then
plays the same ``--episodes`` calculator episodes (the quickstart's env settings; episode ``i``
has seed ``i``: the same task and the same sampling seed under both routers) through
`SGLangEngine` with ``router="palaestra"`` (the Python `Router`) and ``router="sglang"``
(SGLang's router, ``sglang-router``; with ``--sglang-args`` also a third pass of it with those
flags), ``--concurrency`` at a time, ``--repeats`` times each in
alternating order, the workers' prefix caches flushed before every pass. Reports per pass:
episodes/s, generated tokens/s, the requests each worker served and the share of prompt tokens
its prefix cache served (the cache-aware policy's effect). ``--model`` defaults to a fresh tiny
model (``palaestra init-model``), whose random weights rarely end a turn; a trained quickstart
model plays the multi-turn tool episodes the routers are meant for.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: the quickstart's calculator (configs/quickstart.toml)
ENV_KWARGS: dict[str, Any] = {
    "min_value": 10, "max_value": 99, "num_operations": 1, "operators": ["+", "-", "*"],
    "max_turns": 3,
    "system_prompt": "Call the calculator as <tool_call>{\"name\": \"calculator\", \"arguments\": "
                     "{\"expression\": \"...\"}}</tool_call>, then answer <answer>N</answer>.",
}


async def _stats(engine: Any) -> dict[str, dict[str, float]]:
    out = {}
    for client in engine.clients:
        info = await client.request("GET", "/server_info")
        out[client.url] = dict(info["internal_states"][0])
    return out


async def _pass(urls: list[str], label: str, args: argparse.Namespace, model: str,
                log_dir: Path) -> dict[str, Any]:
    from palaestra.agents import make_agent
    from palaestra.engine import SamplingParams
    from palaestra.engines.clients.sglang import SGLangEngine
    from palaestra.envs import make
    from palaestra.rollout.play import run_episode

    router = "palaestra" if label == "palaestra" else "sglang"
    extra = args.sglang_args.split() if label == "sglang+args" else ()
    engine = SGLangEngine(urls, router=router, log_dir=log_dir, router_args=extra)
    await engine.start()
    try:
        for client in engine.clients:
            await client.flush_cache()
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
        gate = asyncio.Semaphore(args.concurrency)

        async def episode(i: int) -> Any:
            async with gate:
                return await run_episode(
                    make("palaestra/Calculator-v0", **ENV_KWARGS),
                    make_agent(model, "qwen", max_context=512, tools_in_prompt=False), engine,
                    dataclasses.replace(sampling, seed=args.seed + i), seed=args.seed + i,
                    session_id=f"ep{i}")

        before = await _stats(engine)
        start = time.perf_counter()
        trajs = await asyncio.gather(*(episode(i) for i in range(args.episodes)))
        seconds = time.perf_counter() - start
        after = await _stats(engine)
    finally:
        await engine.close()
    delta = {url: {k: after[url][k] - before[url][k] for k in
                   ("requests", "prompt_tokens", "cached_tokens", "generated_tokens")}
             for url in after}
    failed = sum(t.error is not None for t in trajs)
    generated = sum(d["generated_tokens"] for d in delta.values())
    prompt = sum(d["prompt_tokens"] for d in delta.values())
    return {
        "router": label, "episodes": len(trajs), "failed": failed, "seconds": round(seconds, 3),
        "episodes_per_s": round(len(trajs) / seconds, 3),
        "generated_tokens_per_s": round(generated / seconds, 1),
        "turns_per_episode": round(sum(len(t.turns) for t in trajs) / len(trajs), 3),
        "reward_mean": round(statistics.fmean(t.reward or 0.0 for t in trajs), 4),
        "requests_per_worker": [int(d["requests"]) for d in delta.values()],
        "cached_prompt_share": round(sum(d["cached_tokens"] for d in delta.values())
                                     / max(prompt, 1), 4),
    }


async def _run(args: argparse.Namespace, model: str, work: Path) -> dict[str, Any]:
    from palaestra.engines.clients.server_process import wait_all_ready
    from palaestra.engines.serve.serve import serve_process

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    workers = [serve_process(model, device="cpu", extra=("--threads", "1"), env=env,
                             log_path=work / f"serve-{i}.log") for i in range(2)]
    try:
        await wait_all_ready(workers, 300)
        urls = [w.url for w in workers]
        passes = []
        labels = ["palaestra", "sglang"] + (["sglang+args"] if args.sglang_args else [])
        for r in range(args.repeats):
            for label in labels if r % 2 == 0 else labels[::-1]:
                result = await _pass(urls, label, args, model, work / f"{label}-{r}")
                print(json.dumps(result), flush=True)
                passes.append(result)
    finally:
        for w in workers:
            w.stop()
    summary = {}
    for label in labels:
        rates = [p["episodes_per_s"] for p in passes if p["router"] == label]
        summary[label] = {"episodes_per_s_median": statistics.median(rates),
                          "episodes_per_s": rates}
    return {"model": model, "episodes": args.episodes, "concurrency": args.concurrency,
            "sglang_args": args.sglang_args,
            "max_new_tokens": args.max_new_tokens, "passes": passes, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: a new tiny model)")
    p.add_argument("--episodes", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="passes per router (alternating)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sglang-args", default="",
                   help="a third pass, SGLang's router with these flags (e.g. "
                   "'--balance-abs-threshold 4')")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    from palaestra.engines.clients.sglang_router import require_router

    require_router()
    with tempfile.TemporaryDirectory(prefix="router-bench-") as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            from palaestra.tiny_model import build_model

            model = str(build_model(work / "tiny", "tiny"))
        out = asyncio.run(_run(args, model, work))
    print(json.dumps(out["summary"], indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

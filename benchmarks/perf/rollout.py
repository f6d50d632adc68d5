"""Rollout framework overhead: env steps/s and episodes/s through the whole stack.

    python benchmarks/perf/rollout.py --json OUT.json            # all settings
    python benchmarks/perf/rollout.py --json OUT.json --quick    # smaller runs (a smoke test)

The stack: `RolloutManager` -> two Ray rollout workers (async actors) -> per episode a real
`Agent` (the tiny model's Qwen-style tokenizer and template) -> a `Router` -> the engine, and the
``palaestra/Calculator-v0`` env with its calculator tool (a trivial tool). Each episode is two
env steps (a tool call, then an answer). Settings:

- ``scripted-C``: an instant `ScriptedEngine` (canned tokens) behind the router inside each
  worker, with C = 100, 1,000 and 5,000 episodes in flight: pure framework throughput.
- ``local-engine``: `palaestra serve` with the tiny model (the embedded engine, one process),
  reached over HTTP; ``framework_frac`` is the share of the episodes' wall time spent neither in
  the engine nor in the env (agent, worker, event-loop queueing).

Each setting runs one warm-up batch, then times one batch of ``episodes`` episodes. Written per
setting: env_steps_per_s, episodes_per_s, episodes, errors (failed episodes), and the time split.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any


def _model(path: Path) -> str:
    if not (path / "config.json").exists():
        from palaestra.tiny_model import build_model

        build_model(path, "tiny")
    return str(path)


def _rows(n: int) -> list[dict[str, Any]]:
    return [
        {"env_id": "palaestra/Calculator-v0", "id": f"b{i}", "question": f"What is {i} * 7?",
         "answer": str(7 * i)}
        for i in range(n)
    ]


async def _run(name: str, pool: Any, worker_config: Any, episodes: int, concurrency: int,
               costs: dict[str, float], group_size: int = 4) -> dict[str, Any]:
    from palaestra.rollout.config import RolloutConfig
    from palaestra.rollout.data import DataSource
    from palaestra.rollout.manager import RolloutManager

    groups = max(1, episodes // group_size)
    cfg = RolloutConfig(batch_size=groups, group_size=group_size, max_concurrency=concurrency,
                        num_workers=len(pool.handles), max_failure_rate=1.0)
    data = DataSource(_rows(10_000), seed=0, epochs=None)
    async with RolloutManager(data, worker_config, cfg, pool=pool) as manager:
        await pool.prewarm("palaestra/Calculator-v0", concurrency)  # steady state: pools full
        manager.config = cfg.model_copy(update={"batch_size": max(1, min(groups, 64))})
        await manager.generate_batch(-1)  # warm-up: imports, tokenizer, env pools
        manager.config = cfg
        before = await manager.worker_stats()
        cpu0, began = time.process_time(), time.perf_counter()
        batch = await manager.generate_batch(0)
        wall, driver_cpu = time.perf_counter() - began, time.process_time() - cpu0
        after = await manager.worker_stats()
    m = batch.metrics
    finished = m["episodes/finished"]
    steps = m["episodes/env_steps"]
    worker_cpu = sum(a["cpu_s"] - b["cpu_s"] for a, b in zip(after, before))
    per_step = 1e3 / max(steps, 1)
    # the agent's CPU inside the workers is measured exactly (its calls are synchronous); the
    # env's is not separable from event-loop queueing there, so its alone-cost stands in
    agent_ms, env_ms = m.get("time/agent_ms_per_step", 0.0), costs["env_ms_per_step"]
    return {
        "setting": name,
        "concurrency": concurrency,
        "episodes": int(finished),
        "env_steps": round(steps),
        "errors": int(m["episodes/failed"]),
        "wall_s": round(wall, 3),
        "env_steps_per_s": round(steps / wall, 1),
        "episodes_per_s": round(finished / wall, 1),
        "tokens_per_s": round(m["perf/tokens_per_s"], 1),
        "engine_frac": round(m.get("time/engine_frac", 0.0), 4),
        "env_frac": round(m.get("time/env_frac", 0.0), 4),
        # the episodes' wall time outside engine and env: agent + worker + loop queueing
        "framework_frac": round(m.get("time/agent_frac", 0.0) + m.get("time/other_frac", 0.0), 4),
        # CPU per env step: the workers' processes in total; the agent's share (measured in
        # the workers) and the env's (measured alone, see `component_costs`); the rest is the
        # framework (worker, router, engine client, asyncio, Ray). The driver apart.
        "worker_cpu_ms_per_step": round(worker_cpu * per_step, 3),
        "agent_ms_per_step": round(agent_ms, 3),
        "env_ms_per_step": round(env_ms, 3),
        "framework_cpu_ms_per_step": round(worker_cpu * per_step - agent_ms - env_ms, 3),
        "driver_cpu_ms_per_step": round(driver_cpu * per_step, 3),
        # what the stack could do with every core to itself (a shared machine's load aside)
        "steps_per_cpu_s": round(steps / max(worker_cpu + driver_cpu, 1e-9), 1),
        "stop_reasons": {k.split("/", 1)[1]: int(v) for k, v in m.items()
                         if k.startswith("stop_reason/")},
    }


class _TimedEnv:
    """Counts the CPU time of an env's reset and steps (run alone: nothing else on the loop)."""

    def __init__(self, env: Any) -> None:
        self.env, self.cpu_s = env, 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)

    async def areset(self, **kwargs: Any) -> Any:
        t = time.thread_time()
        try:
            return await self.env.areset(**kwargs)
        finally:
            self.cpu_s += time.thread_time() - t

    async def astep(self, action: Any) -> Any:
        t = time.thread_time()
        try:
            return await self.env.astep(action)
        finally:
            self.cpu_s += time.thread_time() - t


async def component_costs(model: str, episodes: int = 200) -> dict[str, float]:
    """CPU milliseconds per env step of the agent and of the env, from ``episodes`` canned
    episodes played one at a time through `run_episode` (no concurrency, so no queueing)."""
    from palaestra.agents import AgentSpec
    from palaestra.envs import make
    from palaestra.rollout.play import run_episode
    from palaestra.engine import SamplingParams
    from palaestra.rollout.testing import scripted_router

    engine = scripted_router(model, 1)
    env = _TimedEnv(make("palaestra/Calculator-v0"))
    agent = AgentSpec(model, max_context=2048).build()
    steps, agent_s = 0, 0.0
    for i, row in enumerate(_rows(episodes)):
        traj = await run_episode(env, agent, engine, SamplingParams(max_new_tokens=64), seed=i,
                                 task=row, env_id="palaestra/Calculator-v0")
        steps += len(traj.turns)
        agent_s += traj.metrics["agent_s"]
    return {"agent_ms_per_step": round(1e3 * agent_s / steps, 3),
            "env_ms_per_step": round(1e3 * env.cpu_s / steps, 3)}


def _serve(model: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    from palaestra.engines.serve.serve import serve_argv

    proc = subprocess.Popen(
        serve_argv(model, port=0, extra=("--threads", "1", "--max-running", "64")),
        stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"on (http://\S+)", log.read_text())
        if found:
            return proc, found.group(1)
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"palaestra serve did not start:\n{log.read_text()[-2000:]}")


async def main_async(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, float]]:
    from palaestra.agents import AgentSpec
    from palaestra.rollout.cluster import WorkerPool
    from palaestra.rollout.config import EngineSpec, WorkerConfig
    from palaestra.engine import SamplingParams
    from palaestra.rollout.testing import scripted_router

    model = _model(Path(args.model_dir))
    agent = AgentSpec(model, max_context=2048)
    scripted = WorkerConfig(
        engine=EngineSpec.from_factory(functools.partial(scripted_router, model, 2)),
        agent=agent, sampling=SamplingParams(max_new_tokens=64), poll_s=0.05,
    )
    costs = await component_costs(model)
    print(f"alone, per env step: {costs}", flush=True)
    pool = WorkerPool(scripted, args.workers, cluster=args.cluster, num_cpus=0.5)
    await pool.start()
    results = []
    try:
        scale = 0.2 if args.quick else 1.0
        for concurrency in args.concurrency:
            episodes = int(max(2 * concurrency, 2000) * scale)
            row = await _run(f"scripted-{concurrency}", pool, scripted, episodes, concurrency,
                             costs)
            results.append(row)
            _print_row(row)
        if not args.skip_local_engine:
            with tempfile.TemporaryDirectory() as tmp:
                proc, url = _serve(model, Path(tmp) / "serve.log")
                try:
                    # the random-init model rarely ends a turn: a bias on the turn-end token
                    # makes answers ~16 tokens long, so episodes reach the env
                    end = agent.build().stop_token_ids[0]
                    local = WorkerConfig(
                        engine=EngineSpec.http([url]), agent=agent,
                        sampling=SamplingParams(max_new_tokens=args.max_new_tokens,
                                                logit_bias=((end, 4.0),)),
                    )
                    episodes = int(256 * scale)
                    row = await _run("local-engine", pool, local, episodes, 64, costs)
                    results.append(row)
                    _print_row(row)
                finally:
                    proc.terminate()
                    proc.wait(30)
    finally:
        await pool.close()
    return results, costs


_COLUMNS = ("setting", "concurrency", "episodes", "errors", "env_steps_per_s", "episodes_per_s",
            "agent_ms_per_step", "env_ms_per_step", "framework_cpu_ms_per_step",
            "driver_cpu_ms_per_step", "steps_per_cpu_s", "framework_frac")


def _print_row(row: dict[str, Any]) -> None:
    print("  ".join(f"{k}={row[k]}" for k in _COLUMNS), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--quick", action="store_true", help="a fifth of the episodes")
    parser.add_argument("--model-dir", default="runs/bench-tiny-model",
                        help="tiny model directory (built there when missing)")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[100, 1000, 5000],
                        help="in-flight episodes of the scripted settings (none: skip them)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cluster", default="ray", choices=("ray", "local"))
    parser.add_argument("--max-new-tokens", type=int, default=32,
                        help="per-turn budget of the local-engine setting")
    parser.add_argument("--skip-local-engine", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results, costs = asyncio.run(main_async(args))
    print()
    widths = {c: max(len(c), *(len(str(r[c])) for r in results)) for c in _COLUMNS}
    print("  ".join(c.rjust(widths[c]) for c in _COLUMNS))
    for r in results:
        print("  ".join(str(r[c]).rjust(widths[c]) for c in _COLUMNS))
    if args.json:
        out = {
            "benchmark": "rollout",
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "workers": args.workers,
            "alone_ms_per_step": costs,
            "cluster": args.cluster,
            "settings": results,
        }
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

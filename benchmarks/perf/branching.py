"""Branching groups vs independent episodes: the same 8 leaves per prompt, fewer tokens and runs.

Run:  python benchmarks/perf/branching.py --json /tmp/branching.json        (about 2-4 minutes)
      python benchmarks/perf/branching.py --quick                            (a small setting)

Both sides go through `palaestra.rollout.branching.play_branching_group`: independent episodes
are the tree without branch points (every leaf its own root), so the comparison is of the tree
alone. Settings (each: branch points at turns 1 and 2, width 2, i.e. 2 roots x 4 leaves):

- ``calculator``: ``palaestra/Calculator-v0`` with 3 operations, a scripted policy that calls
  the calculator 3 times, then answers (right half of the time): 4 turns per episode; the
  scripted engine counts generated tokens and requests (instant, so wall time is rollout
  overhead only).
- ``echo-local``: the embedded torch engine (micro model, CPU) on a 4-turn echo env: real
  prefill/decode work, so tokens generated, tokens prefilled, tokens reused from the prefix
  cache and wall time are all the engine's own counters.
- ``python-session``: a code env whose episodes keep a persistent python interpreter in a
  sandbox session (`SessionPythonEnv`), scripted code turns; a fork forks the interpreter
  (`SandboxSession.fork`): sandbox runs and forks are counted, wall time is sandbox-bound;
  ``python-50ms`` is the same with cells that each burn 50 ms of CPU (costly state).

The JSON has one row per setting and mode and, per setting, ``generated_token_ratio``
(independent over branching generated tokens), ``wall_time_ratio``, ``prefill_token_ratio``
(where the engine reports it) and ``sandbox_run_ratio``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import tempfile
import time
from collections.abc import Sequence
from typing import Any, ClassVar

from palaestra.envs.base import MultiTurnEnv, StepResult
from palaestra.types import Message

TURNS, WIDTH, LEAVES = (1, 2), 2, 8


class EchoEnv(MultiTurnEnv):
    """Four turns of small talk; reward 1 when the last reply has an even length."""

    step_in_thread = False

    def initial_messages(self, task: Any) -> list[Message]:
        return [Message(role="user", content=f"Tell me about {task['topic']}, in four parts.")]

    def respond(self, action: Message) -> StepResult:
        reward = float(self.turn >= self.max_turns and len(action.content) % 2 == 0)
        return StepResult([Message(role="user", content=f"part {self.turn} noted, go on")], reward)


class SessionPythonEnv(MultiTurnEnv):
    """Each turn's code runs in one persistent python interpreter (a sandbox session); reward 1
    when the last printed number is odd. ``afork`` forks the interpreter with the episode; the
    cells run so far are part of the snapshot, and ``areplay`` re-creates the interpreter from
    them after a `restore` (an in-flight episode resumed in a new process)."""

    step_in_thread = False
    snapshot_exclude: ClassVar[tuple[str, ...]] = ("_dataset", "sandbox", "session", "counts")

    def __init__(self, sandbox: Any, counts: dict[str, int] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sandbox = sandbox
        self.session: Any = None
        self.counts = counts if counts is not None else {"runs": 0}  # shared by forks
        self.cells: list[str] = []

    def initial_messages(self, task: Any) -> list[Message]:
        return [Message(role="user", content=f"Start from x = {task['x']}; each turn, write "
                        "python that updates x and prints it.")]

    async def areset(self, *, seed: int | None = None,
                     options: dict[str, Any] | None = None) -> Any:
        await self.aclose_session()
        self.session = await self.sandbox.session(persistent_python=True).open()
        self.cells = []
        return self.reset(seed=seed, options=options)

    async def aon_action(self, action: Message) -> StepResult:
        result = await self.session.run(action.content, timeout=10.0)
        self.counts["runs"] += 1
        self.cells.append(action.content)
        out = (result.stdout or "").strip() or (result.stderr or "")[-200:]
        numbers = re.findall(r"-?\d+", out)
        reward = float(self.turn >= self.max_turns and bool(numbers) and int(numbers[-1]) % 2)
        return self._with_rewards(action, StepResult([Message(role="user", content=out)], reward))

    async def afork(self) -> SessionPythonEnv:
        clone = self.fork()
        assert isinstance(clone, SessionPythonEnv)
        clone.session = await self.session.fork()
        return clone

    async def areplay(self) -> None:
        """A new interpreter that ran this episode's cells (after `restore`)."""
        self.session = await self.sandbox.session(persistent_python=True).open()
        for cell in self.cells:
            await self.session.run(cell, timeout=10.0)
            self.counts["runs"] += 1

    async def aclose_session(self) -> None:
        if self.session is not None:
            session, self.session = self.session, None
            await session.close()


class CodePolicy:
    """Scripted python turns: first ``x = <given>``-style setup, then random updates of x;
    each cell first burns ``work_ms`` of CPU (state that is costly to rebuild)."""

    def __init__(self, tokenizer_path: str, work_ms: int = 0) -> None:
        self.tokenizer_path = tokenizer_path
        self.work_ms = work_ms
        self._tok: Any = None

    def __call__(self, input_ids: Sequence[int], rng: random.Random) -> list[int]:
        from palaestra.agents import load_tokenizer

        tok = self._tok = self._tok or load_tokenizer(self.tokenizer_path)
        text = str(tok.decode(list(input_ids), skip_special_tokens=False))
        turn = text.count("<|im_start|>assistant") - 1
        if turn == 0:
            start = re.findall(r"x = (\d+)", text)[-1]
            code = f"x = {start}\nprint(x)"
        else:
            code = f"x = x * {rng.randint(2, 5)} + {rng.randint(0, 3)}\nprint(x)"
        if self.work_ms:
            code = (f"import time\nt = time.process_time()\nwhile time.process_time() - t < "
                    f"{self.work_ms / 1000}:\n    pass\n") + code
        return [*tok.encode(code, add_special_tokens=False),
                tok.convert_tokens_to_ids("<|im_end|>")]


async def _play(engine: Any, make_env: Any, spec: Any, tasks: list[dict], branching: Any,
                sampling: Any, env_id: str) -> dict[str, Any]:
    from palaestra.rollout.branching import TreeHooks, TreeRequest, play_branching_group

    envs: list[Any] = []

    def acquire() -> Any:
        env = make_env()
        envs.append(env)
        return env

    hooks = TreeHooks(acquire_env=acquire, release_env=envs.append, acquire_agent=spec.build,
                      release_agent=lambda a: None, wait_gate=lambda: asyncio.sleep(0))
    began = time.perf_counter()
    groups = await asyncio.gather(*(
        play_branching_group(TreeRequest(f"g{i}", env_id, task, tuple(range(i * 100,
                                         i * 100 + LEAVES)), branching, sampling), engine, hooks)
        for i, task in enumerate(tasks)))
    wall = time.perf_counter() - began
    leaves = [t for g in groups for t in g]
    unique = {id(e): e for e in envs}.values()
    out = {
        "wall_s": wall,
        "leaves": len(leaves),
        "failed": sum(t.failed for t in leaves),
        "turns_mean": sum(len(t.turns) for t in leaves) / max(len(leaves), 1),
        "reward_mean": sum(t.reward for t in leaves) / max(len(leaves), 1),
        "forks": len(hooks.forks),
        "fork_ms_p50": 1000 * sorted(hooks.forks)[len(hooks.forks) // 2] if hooks.forks else 0.0,
        "envs": len(unique),
    }
    counts = {id(e.counts): e.counts for e in unique if hasattr(e, "counts")}
    if counts:
        out["sandbox_runs"] = sum(c["runs"] for c in counts.values())
    for e in unique:
        closer = getattr(e, "aclose_session", None)
        if closer is not None:
            await closer()
    return out


def _engine_counts(engine: Any) -> dict[str, float]:
    stats = getattr(engine, "stats", None)
    if isinstance(stats, dict):
        return {k: float(stats[k]) for k in ("generated_tokens", "prefill_tokens",
                                             "cached_tokens", "requests")}
    return {"generated_tokens": float(engine.generated_tokens), "requests": float(engine.requests)}


async def _compare(name: str, build: Any) -> list[dict[str, Any]]:
    from palaestra.rollout.groups import Branching

    rows = []
    for mode, branching in (("independent", Branching((), 1)),
                            ("branching", Branching(TURNS, WIDTH))):
        engine, make_env, spec, tasks, sampling, env_id, cleanup = await build()
        try:
            before = _engine_counts(engine)
            row = await _play(engine, make_env, spec, tasks, branching, sampling, env_id)
            after = _engine_counts(engine)
        finally:
            await cleanup()
        row.update({k: after[k] - before[k] for k in after})
        rows.append({"setting": name, "mode": mode, **row})
        print(f"  {name:15s} {mode:12s} " + " ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
            flush=True)
    return rows


def _ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for setting in dict.fromkeys(r["setting"] for r in rows):
        ind = next(r for r in rows if r["setting"] == setting and r["mode"] == "independent")
        br = next(r for r in rows if r["setting"] == setting and r["mode"] == "branching")
        ratio = {}
        for key, name in (("generated_tokens", "generated_token_ratio"),
                          ("wall_s", "wall_time_ratio"), ("prefill_tokens", "prefill_token_ratio"),
                          ("sandbox_runs", "sandbox_run_ratio"), ("requests", "request_ratio")):
            if key in ind and br.get(key):
                ratio[name] = ind[key] / br[key]
        out[setting] = ratio
    return out


async def main_async(quick: bool) -> dict[str, Any]:
    from palaestra.agents import AgentSpec
    from palaestra.envs import make
    from palaestra.engine import SamplingParams
    from palaestra.engines.local.local import LocalEngine
    from palaestra.engines.clients.scripted import ScriptedEngine
    from palaestra.rollout.testing import CalculatorPolicy
    from palaestra.tiny_model import build_model

    model = str(build_model(tempfile.mkdtemp(prefix="branching-bench-"), "micro"))
    spec = AgentSpec(model)
    n_prompts = 2 if quick else 4

    async def nothing() -> None:
        return None

    async def calculator() -> tuple:
        engine = ScriptedEngine(CalculatorPolicy(model, p_correct=0.5, n_calls=3))
        tasks = [{"id": f"c{i}", "question": f"What is {10 + i} + {20 + i} * {3 + i} - 7?",
                  "answer": str(10 + i + (20 + i) * (3 + i) - 7)} for i in range(n_prompts)]
        return (engine, lambda: make("palaestra/Calculator-v0", max_turns=6), spec, tasks,
                SamplingParams(max_new_tokens=64), "palaestra/Calculator-v0", nothing)

    async def echo_local() -> tuple:
        engine = LocalEngine(model, max_running=64, use_thread=False)
        stops = tuple(range(0, len(spec.build().tokenizer), 8))  # turns of ~8 tokens
        tasks = [{"topic": t} for t in ("cats", "rivers", "trains", "clocks")[:n_prompts]]

        async def close() -> None:
            await engine.close()

        return (engine, lambda: EchoEnv(max_turns=4), spec, tasks,
                SamplingParams(max_new_tokens=24, temperature=1.0, stop_token_ids=stops),
                "echo", close)

    def python_session(work_ms: int) -> Any:
        async def build() -> tuple:
            from palaestra.sandbox import LocalSandbox

            box = LocalSandbox()
            await box.__aenter__()
            engine = ScriptedEngine(CodePolicy(model, work_ms))
            tasks = [{"x": 3 + i} for i in range(max(1, n_prompts // 2))]
            counts = {"runs": 0}

            async def close() -> None:
                await box.__aexit__(None, None, None)

            return (engine, lambda: SessionPythonEnv(box, counts, max_turns=4), spec, tasks,
                    SamplingParams(max_new_tokens=64), "python-session", close)

        return build

    rows: list[dict[str, Any]] = []
    print(f"{n_prompts} prompts x {LEAVES} leaves; branching turns {list(TURNS)} width {WIDTH}")
    rows += await _compare("calculator", calculator)
    rows += await _compare("echo-local", echo_local)
    rows += await _compare("python-session", python_session(0))
    rows += await _compare("python-50ms", python_session(50))
    ratios = _ratios(rows)
    print("\nsetting          generated  prefill  wall   sandbox-runs  (independent / branching)")
    for setting, r in ratios.items():
        print(f"  {setting:15s} {r.get('generated_token_ratio', float('nan')):6.2f}x  "
              f"{r.get('prefill_token_ratio', float('nan')):6.2f}x "
              f"{r.get('wall_time_ratio', float('nan')):5.2f}x "
              f"{r.get('sandbox_run_ratio', float('nan')):6.2f}x")
    return {"leaves_per_prompt": LEAVES, "turns": list(TURNS), "width": WIDTH,
            "prompts": n_prompts, "rows": rows, "ratios": ratios}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="fewer prompts (CI smoke)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    result = asyncio.run(main_async(args.quick))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

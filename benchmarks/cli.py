"""``palaestra eval``: evaluate a model on benchmarks, list benchmarks, compare two runs.

    palaestra eval --benchmark gsm8k --engine local --model runs/tiny-model --n 8 \\
        --temperature 0.6 --limit 200 --concurrency 64 --out runs/eval-x
    palaestra eval --benchmark gsm8k,math500 --engine openai --model gpt-4o-mini --rpm 500
    palaestra eval --benchmark hotpotqa --engine sglang --model http://127.0.0.1:30000
    palaestra eval --benchmark calculator --model runs/quickstart/final-model
    palaestra eval list
    palaestra eval compare runs/eval-base runs/eval-rl
    palaestra eval report runs/eval-x        # rebuild summary.json and report.md from samples

Rerunning the same command resumes: finished samples in ``OUT/samples.jsonl`` are skipped.

A model exported by ``palaestra train`` carries the settings it was trained with
(``final-model/trained_with.json``: family, tools in the prompt, context, the held-out evaluation's
sampling, env kwargs); they are used unless a flag overrides them (``--no-trained-settings``:
ignore the file). Tokens per turn and env kwargs apply to benchmarks on the training env only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what to evaluate")
    g.add_argument("--benchmark", "-b", action="append", default=[],
                   help="benchmark name(s), comma-separated or repeated (see `palaestra eval list`)")
    g.add_argument("--limit", type=int, default=None, help="first N tasks of each benchmark")
    g.add_argument("--dataset", action="append", default=[], metavar="[BENCH=]PATH",
                   help="use this JSONL file of task rows instead of the shipped one")
    g.add_argument("--env-kwargs", action="append", default=[], metavar="[BENCH=]JSON",
                   help="extra env keyword arguments, e.g. '{\"python_tool\": true}'")
    g.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import a module first (one that registers your benchmarks or envs)")
    m = p.add_argument_group("model")
    m.add_argument("--engine", choices=("local", "sglang", "openai"), default="local",
                   help="local: embedded engine on a checkpoint; sglang: running servers; "
                        "openai: any OpenAI-compatible API")
    m.add_argument("--model", help="checkpoint PATH (local), server URL(s) (sglang), model NAME (openai)")
    m.add_argument("--model-name", default=None, help="name to key samples by (default: from --model)")
    m.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's)")
    m.add_argument("--family", default=None,
                   help="chat/tool-call family of the model (qwen, llama3, ...; default: as trained, "
                        "else qwen)")
    m.add_argument("--max-context", type=int, default=None,
                   help="context length of an episode, tokens (default: as trained, else 4096)")
    m.add_argument("--tools-in-prompt", action=argparse.BooleanOptionalAction, default=None,
                   help="put the env's tool schemas into the chat template (default: as trained, "
                        "else yes); --no-tools-in-prompt when the env's own prompt describes them")
    m.add_argument("--no-trained-settings", action="store_true",
                   help="ignore the settings recorded beside the model (MODEL/trained_with.json)")
    m.add_argument("--base-url", default=None, help="OpenAI-compatible base URL (openai engine)")
    m.add_argument("--api-key-env", default="OPENAI_API_KEY", help="variable holding the API key")
    m.add_argument("--device", default=None, help="device of the local engine (cpu, cuda)")
    s = p.add_argument_group("sampling")
    s.add_argument("--n", type=int, default=1, help="samples per task (pass@k for every k <= n)")
    s.add_argument("--temperature", type=float, default=None, help="default: as trained, else 0.6")
    s.add_argument("--top-p", type=float, default=None, help="default: as trained, else 1.0")
    s.add_argument("--top-k", type=int, default=None, help="default: as trained, else -1 (off)")
    s.add_argument("--max-new-tokens", type=int, default=None, help="per turn (default: per benchmark)")
    s.add_argument("--max-turns", type=int, default=None, help="per episode (default: the env's)")
    s.add_argument("--seed", type=int, default=0, help="base of the per-sample seeds")
    r = p.add_argument_group("running")
    r.add_argument("--concurrency", type=int, default=64, help="episodes in flight")
    r.add_argument("--rpm", type=float, default=None, help="request rate limit per minute (remote)")
    r.add_argument("--retries", type=int, default=6, help="retries of a request on 429/5xx")
    r.add_argument("--timeout", type=float, default=600.0, help="seconds per request / env step")
    r.add_argument("--out", default=None, help="output folder (default runs/eval-MODEL)")
    r.add_argument("--no-progress", action="store_true", help="no progress bars")
    r.add_argument("--no-report", action="store_true", help="skip report.md and its plots")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "subcommands: `palaestra eval list`, `palaestra eval compare RUN_A RUN_B`, "
        "`palaestra eval report RUN`"
    )
    sub = parser.add_subparsers(dest="action", metavar="{list,compare,report}")
    ls = sub.add_parser("list", help="registered benchmarks and whether their env is available")
    ls.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE")
    cmp_ = sub.add_parser("compare", help="per-benchmark deltas with bootstrap CIs, flipped tasks")
    cmp_.add_argument("run_a")
    cmp_.add_argument("run_b")
    cmp_.add_argument("--model-a", default=None, help="model of run A (when it holds several)")
    cmp_.add_argument("--model-b", default=None, help="model of run B (when it holds several)")
    cmp_.add_argument("--draws", type=int, default=2000, help="bootstrap resamples")
    cmp_.add_argument("--json", default=None, metavar="OUT", help="also write the comparison as JSON")
    rep = sub.add_parser("report", help="rebuild summary.json and report.md from samples.jsonl")
    rep.add_argument("run")
    rep.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE")
    _add_run_flags(parser)


def _split(values: list[str]) -> list[str]:
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def _per_benchmark(values: list[str], names: list[str], parse: Any, flag: str) -> dict[str, Any]:
    """``[BENCH=]VALUE`` items -> {bench: value}; a bare VALUE applies to every benchmark."""
    from palaestra.errors import ConfigError

    out: dict[str, Any] = {}
    for item in values:
        head, sep, tail = item.partition("=")
        if sep and head in names and not head.lstrip().startswith("{"):
            targets, text = [head], tail
        else:
            targets, text = names, item
        try:
            value = parse(text)
        except ValueError as exc:
            raise ConfigError(f"{flag} {item!r}: {exc}") from None
        for name in targets:
            if isinstance(value, dict):
                out[name] = {**out.get(name, {}), **value}
            else:
                out[name] = value
    return out


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object")
    return value


def _imports(modules: list[str]) -> None:
    import importlib

    for module in modules:
        importlib.import_module(module)


def _list() -> int:
    from palaestra.benchmarks.registry import env_available, list_benchmarks

    for b in list_benchmarks():
        why = env_available(b)
        status = "ok" if why is None else f"unavailable: {why}"
        needs = f" [needs {', '.join(b.required_env_kwargs)}]" if b.required_env_kwargs else ""
        print(f"{b.name:14s} {b.env_id:28s} {b.description}{needs} ({status})")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from palaestra.benchmarks.compare import compare_runs, comparison_json, format_comparison

    rows = compare_runs(args.run_a, args.run_b, model_a=args.model_a, model_b=args.model_b, draws=args.draws)
    print(f"A = {args.run_a}\nB = {args.run_b}\n")
    print(format_comparison(rows))
    if args.json:
        Path(args.json).write_text(comparison_json(rows))
    return 0


def _report(args: argparse.Namespace) -> int:
    from palaestra.benchmarks.registry import get_benchmark, list_benchmarks
    from palaestra.benchmarks.report import write_report
    from palaestra.benchmarks.store import SAMPLES, read_records
    from palaestra.benchmarks.summary import summarize, write_summary
    from palaestra.errors import ConfigError

    path = Path(args.run) / SAMPLES
    if not path.exists():
        raise ConfigError(f"{args.run} has no {SAMPLES}")
    by_bench: dict[str, list[dict[str, Any]]] = {}
    for record in read_records(path):
        by_bench.setdefault(record["benchmark"], []).append(record)
    known = {b.name for b in list_benchmarks()}
    summaries = {
        name: summarize(rows, with_maj=name not in known or get_benchmark(name).answer is not None)
        for name, rows in by_bench.items()
    }
    write_summary(args.run, summaries)
    header: dict[str, Any] = {}
    meta_path = Path(args.run) / "run.json"
    if meta_path.exists():  # the settings each model was evaluated with
        models = json.loads(meta_path.read_text()).get("models", {})
        for model, per_benchmark in models.items():
            for name, settings in per_benchmark.items():
                shown = ", ".join(f"{k}={v}" for k, v in settings.items())
                header[f"{name}, model {model}"] = shown
    report = write_report(args.run, summaries, by_bench, header=header)
    print(f"wrote {report}")
    return 0


def _trained_settings(args: argparse.Namespace) -> tuple[Any, str | None]:
    """The settings recorded beside ``--model`` (or ``--tokenizer``) and where, or (None, None)."""
    from palaestra.trained_settings import FILENAME, read_trained_settings

    if args.no_trained_settings:
        return None, None
    for folder in (args.model if args.engine == "local" else None, args.tokenizer):
        if folder and Path(folder).expanduser().is_dir():
            settings = read_trained_settings(folder)
            if settings is not None:
                return settings, str(Path(folder) / FILENAME)
    return None, None


def _first(*values: Any) -> Any:
    return next(v for v in values if v is not None)


#: env kwargs that define a benchmark's score, not how the episode plays: a run's own (e.g. the
#: Search-R1 env's ``reward = "f1"``, a ``format_reward``) never replace the benchmark's
SCORING_ENV_KWARGS = frozenset({"reward", "format_reward"})


def played_as_trained(benchmark_kwargs: Mapping[str, Any],
                      trained_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The benchmark's env kwargs with the training run's on top (prompt, budgets, retriever),
    except those that define the score."""
    played = {k: v for k, v in trained_kwargs.items() if k not in SCORING_ENV_KWARGS}
    return {**benchmark_kwargs, **played}


def _same_env(a: str, b: str) -> bool:
    return a.rpartition(":")[2] == b.rpartition(":")[2]  # "module:env/Id-v0" names the same env


def _evaluate(args: argparse.Namespace) -> int:
    import asyncio

    from palaestra.benchmarks.backends import BackendOptions, build_policy
    from palaestra.benchmarks.registry import resolve
    from palaestra.benchmarks.runner import EvalSettings, evaluate
    from palaestra.trained_settings import TrainedSettings
    from palaestra.errors import ConfigError

    names = _split(args.benchmark)
    if not names:
        raise ConfigError("pass --benchmark NAME (see `palaestra eval list`)")
    if not args.model:
        raise ConfigError("pass --model (a checkpoint path, server URL or API model name)")
    trained, source = _trained_settings(args)
    if trained is not None:
        print(f"settings as trained ({source}): {trained.describe()}; flags override them")
    t = trained or TrainedSettings(temperature=0.6)  # the defaults without a record
    tools_in_prompt = _first(args.tools_in_prompt, t.tools_in_prompt)
    benchmarks = []
    for b in resolve(names):
        agent = {**b.agent, "tools_in_prompt": tools_in_prompt}
        if t.chat_template is not None:
            agent.setdefault("chat_template", t.chat_template)
        changes: dict[str, Any] = {"agent": agent}
        if trained is not None and _same_env(b.env_id, trained.env_id):
            changes["env_kwargs"] = played_as_trained(b.env_kwargs, trained.env_kwargs)
            if trained.max_new_tokens is not None:
                changes["max_new_tokens"] = trained.max_new_tokens
        benchmarks.append(b.with_overrides(**changes))
    settings = EvalSettings(
        n=args.n,
        temperature=_first(args.temperature, t.temperature),
        top_p=_first(args.top_p, t.top_p),
        top_k=_first(args.top_k, t.top_k),
        max_new_tokens=args.max_new_tokens,
        max_turns=args.max_turns,
        limit=args.limit,
        concurrency=args.concurrency,
        seed=args.seed,
        step_timeout_s=args.timeout,
    )
    env_kwargs = _per_benchmark(args.env_kwargs, names, _json_object, "--env-kwargs")
    datasets = _per_benchmark(args.dataset, names, str, "--dataset")
    policy = build_policy(
        BackendOptions(
            engine=args.engine,
            model=args.model,
            tokenizer=args.tokenizer,
            family=_first(args.family, t.family),
            max_context=_first(args.max_context, t.max_context),
            enable_thinking=t.enable_thinking,
            base_url=args.base_url,
            api_key_env=args.api_key_env,
            rpm=args.rpm,
            retries=args.retries,
            timeout_s=args.timeout,
            device=args.device,
            model_name=args.model_name,
        )
    )
    out = args.out or f"runs/eval-{Path(policy.model.rstrip('/')).name or 'model'}"

    async def main() -> dict[str, Any]:
        try:
            return await evaluate(
                benchmarks,
                policy,
                settings,
                out_dir=out,
                env_kwargs=env_kwargs,
                datasets=datasets,
                progress=not args.no_progress,
                report=not args.no_report,
                header={"engine": args.engine, "benchmarks": ", ".join(names),
                        "settings as trained": source or "none recorded",
                        "tools in prompt": tools_in_prompt},
            )
        finally:
            await policy.close()

    try:
        summaries = asyncio.run(main())
    except KeyboardInterrupt:
        print(f"\ninterrupted; finished samples are in {out}; rerun the same command to resume",
              file=sys.stderr)
        return 130
    for name, s in summaries.items():
        n = s["n"]
        parts = [f"pass@1 {s['pass@1']:.4f}"]
        if n > 1:
            parts.append(f"pass@{n} {s[f'pass@{n}']:.4f}")
        if n > 1 and f"maj@{n}" in s:
            parts.append(f"maj@{n} {s[f'maj@{n}']:.4f}")
        parts.append(f"mean reward {s['mean']:.4f}")
        print(f"{name}: {', '.join(parts)} over {s['tasks']} tasks x {n} samples")
    print(f"wrote {out}/samples.jsonl, summary.json" + ("" if args.no_report else ", report.md"))
    return 0


def run(args: argparse.Namespace) -> int:
    from palaestra.errors import PalaestraError

    try:
        _imports(getattr(args, "imports", []) or [])
        if args.action == "list":
            return _list()
        if args.action == "compare":
            return _compare(args)
        if args.action == "report":
            return _report(args)
        return _evaluate(args)
    except PalaestraError as exc:
        print(f"palaestra eval: error: {exc}", file=sys.stderr)
        return 2


__all__ = ["configure", "run"]

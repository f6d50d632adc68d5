"""``palaestra envs list|check|play``: inspect, verify and play environments by hand."""

from __future__ import annotations

import argparse
import json
from typing import Any


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="registered envs with their description and tools")
    check = sub.add_parser("check", help="gymnasium's check_env plus palaestra's own checks")
    check.add_argument("ids", nargs="*", help="env ids (default: every palaestra env)")
    check.add_argument("--kwargs", default="{}",
                       help='env kwargs as JSON, e.g. \'{"url": "http://127.0.0.1:8000"}\' for '
                            "ecosystem/OpenEnv-v0")
    play = sub.add_parser("play", help="type the assistant turns yourself")
    play.add_argument("id", help="env id, e.g. palaestra/Calculator-v0")
    play.add_argument("--seed", type=int, default=0)
    play.add_argument("--kwargs", default="{}", help="env kwargs as JSON")


def run(args: argparse.Namespace) -> int:
    import palaestra.envs as envs

    if args.action == "list":
        for env_id in envs.palaestra_env_ids():
            info = envs.describe(env_id)
            tools = ", ".join(info.tools) or "-"
            text = info.description if info.error is None else f"(unavailable: {info.error})"
            print(f"{env_id:34s} source: {_source(env_id):9s} tools: {tools:24s} {text}")
        from palaestra.envs.ecosystem import ECOSYSTEM_ENVS

        for env_id in ECOSYSTEM_ENVS:  # adapters: they need arguments before they can list tools
            print(f"{env_id:34s} source: {_source(env_id):9s} adapter, needs {_NEEDS[env_id]}")
        return 0
    if args.action == "check":
        from palaestra.envs.checks import check_env_id

        kwargs = json.loads(args.kwargs)
        failed = 0
        for env_id in args.ids or envs.palaestra_env_ids():
            report = check_env_id(_with_kwargs(env_id, kwargs) if kwargs else env_id)
            status = "ok" if report.ok else "FAILED"
            print(f"{env_id}: {status} ({len(report.passed)}/{len(report.passed) + len(report.failed)})")
            for name, why in report.failed.items():
                print(f"  - {name}: {why}")
            failed += not report.ok
        return 1 if failed else 0
    return _play(args.id, args.seed, json.loads(args.kwargs))


_NEEDS = {"ecosystem/OpenEnv-v0": "url=",
          "ecosystem/Verifiers-v0": "taskset_id= or taskset= (or the id verifiers:<taskset id>)"}


def _source(env_id: str) -> str:
    """Where an env comes from: native, or the ecosystem protocol it adapts (mcp, openenv...)."""
    import gymnasium

    spec = gymnasium.registry.get(env_id)
    entry = str(spec.entry_point) if spec is not None else ""
    if ".ecosystem." not in entry:
        return "native"
    module = entry.split(".ecosystem.", 1)[1].split(":", 1)[0]
    return {"mcp_env": "mcp", "notes": "mcp", "openenv_env": "openenv",
            "verifiers_env": "verifiers"}.get(module, module)


def _with_kwargs(env_id: str, kwargs: dict[str, Any]) -> str:
    """A private id for ``env_id`` with ``kwargs`` as defaults, so every check builds it so."""
    import gymnasium

    import palaestra.envs.ecosystem  # noqa: F401 - registers the adapters (ecosystem/...)
    from palaestra.envs.registry import register

    spec = gymnasium.spec(env_id)
    if spec.entry_point is None:
        from palaestra.errors import EnvNotFoundError

        raise EnvNotFoundError(f"{env_id} was registered without an entry point; register it "
                               "with one ('pkg.module:Class') to check it")
    check_id = f"palaestra-check/{spec.name}-v{spec.version or 0}"
    gymnasium.registry.pop(check_id, None)
    register(check_id, spec.entry_point, **{**spec.kwargs, **kwargs})
    return check_id


def _play(env_id: str, seed: int, kwargs: dict[str, Any]) -> int:
    import palaestra.envs as envs

    env = envs.make(env_id, **kwargs)
    observation, info = env.reset(seed=seed)
    if info.get("tools"):
        names = ", ".join(t["function"]["name"] for t in info["tools"])
        print(f"tools: {names}  (call one with <tool_call>{{\"name\": ..., \"arguments\": {{...}}}}</tool_call>)")
    total = 0.0
    while True:
        for message in observation:
            print(f"[{message.role}] {message.content}")
        try:
            line = input("assistant> ")
        except EOFError:
            print()
            break
        observation, reward, terminated, truncated, step_info = env.step(line)  # text: tool calls parsed by the env
        total += reward
        print(f"  reward={reward:g} terminated={terminated} truncated={truncated} {step_info}")
        if terminated or truncated:
            for message in observation:
                print(f"[{message.role}] {message.content}")
            print(f"episode over: return {total:g} ({step_info.get('stop_reason', '')})")
            break
    env.close()
    return 0


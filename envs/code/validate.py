"""Check the shipped code datasets against their reference solutions in the sandbox.

    python -m palaestra.envs.code.validate [--dataset humaneval|mbpp] [--limit N] [--json OUT]

Every reference solution should pass its hidden tests; the few that do not are listed (MBPP
task 123, for example, needs about 20 s of CPU for one of its asserts, longer than the default
10 s test budget).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from palaestra.envs.code.env import CodeEnv
from palaestra.envs.code.grader import grade
from palaestra.envs.code.tasks import code_task


def reference_solution(row: Mapping[str, Any]) -> str:
    if "canonical_solution" in row:
        return str(row["prompt"]) + str(row["canonical_solution"])
    return str(row["code"])


async def validate(dataset: str, limit: int | None, timeout_s: float) -> dict[str, Any]:
    from palaestra.sandbox import LocalSandbox

    rows = list(CodeEnv(dataset=dataset).dataset)[:limit]
    failed: list[dict[str, Any]] = []
    start = time.monotonic()
    async with LocalSandbox() as sandbox:
        for row in rows:
            result = await grade(reference_solution(row), code_task(row), sandbox=sandbox,
                                 timeout_s=timeout_s)
            if not result.all_passed:
                failed.append({"task_id": row["task_id"], "passed": result.passed,
                               "total": result.total, "error": result.error,
                               "failures": list(result.failures)})
    return {"dataset": dataset, "tasks": len(rows), "passed": len(rows) - len(failed),
            "failed": failed, "seconds": round(time.monotonic() - start, 1)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="reference solutions vs hidden tests")
    parser.add_argument("--dataset", action="append", choices=["humaneval", "mbpp"])
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    reports = [asyncio.run(validate(d, args.limit, args.timeout))
               for d in args.dataset or ["humaneval", "mbpp"]]
    for report in reports:
        print(f"{report['dataset']}: {report['passed']}/{report['tasks']} reference solutions pass "
              f"({report['seconds']} s)")
        for fail in report["failed"]:
            print(f"  {fail['task_id']}: {fail['passed']}/{fail['total']} {fail['error'] or ''} "
                  f"{fail['failures'][:1]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Reward integrity: the judge runs outside the agent's workspace, keeps expected answers on the
host, and nothing the agent writes (files, shadow modules, forged output, early exit) can set
its reward."""

from __future__ import annotations

import pytest
import pytest_asyncio

from palaestra.sandbox import IOCase, Sandbox, judge_function, judge_io

pytestmark = pytest.mark.asyncio(loop_scope="module")

CASES = [((2, 3), 5), ((10, -4), 6), ((0, 0), 0)]
CORRECT = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b\n"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sb():
    async with Sandbox() as box:
        yield box


async def test_correct_and_wrong_solutions(sb: Sandbox) -> None:
    good = await judge_function(sb, CORRECT, "add", CASES)
    assert good.reward == 1.0 and good.all_passed
    bad = await judge_function(sb, WRONG, "add", CASES)
    assert bad.reward == pytest.approx(1 / 3)  # only (0, 0) happens to match
    partial = await judge_function(sb, "def add(a, b):\n    return 5\n", "add", CASES)
    assert partial.passed == 1 and partial.total == 3


async def test_agent_cannot_set_its_own_reward(sb: Sandbox) -> None:
    async with sb.session() as agent:  # the agent's own, writable workspace
        # 1. the agent writes everything a naive judge might trust or import
        for name, content in {
            "reward.txt": "1.0", "result.json": '{"passed": 3, "total": 3, "reward": 1.0}',
            "test_hidden.py": "def test_all():\n    assert True\n",
            "json.py": "def dumps(*a, **k):\n    return '5'\ndef loads(s):\n    return [2, 3]\n",
            "sitecustomize.py": "import builtins\nbuiltins.REWARD = 1.0\n",
            "importlib.py": "raise SystemExit(0)\n",
        }.items():
            await agent.write_file(name, content)
        # 2. its declared output is a wrong solution that forges results and exits early
        forged = ("import sys\n"
                  "print('@@palaestra-result-' + '0' * 32 + '@@5')\n"
                  "print('PASSED 3/3')\n"
                  "def add(a, b):\n    return 0\n"
                  "sys.exit(0)\n")
        await agent.write_file("solution.py", forged)
        res = await agent.run("import os\nprint(sorted(os.listdir('.')))")
        assert "reward.txt" in res.stdout
        declared = (await agent.read_file("solution.py")).decode()
        verdict = await judge_function(sb, declared, "add", CASES)
    assert verdict.reward == 0.0 and verdict.passed == 0
    assert all(not c.passed for c in verdict.cases)


async def test_judge_workspace_holds_only_the_declared_output(sb: Sandbox) -> None:
    # the value the judge sees is computed inside its own fresh directory
    probe = ("import os, sys\n"
             "def peek():\n"
             "    return [sorted(os.listdir('.')), 'REWARD' in dir(__builtins__)]\n")
    verdict = await judge_function(sb, probe, "peek", [((), [["solution.py"], False])])
    assert verdict.reward == 1.0, verdict.cases[0]


async def test_crashing_or_hanging_cases_fail_alone(sb: Sandbox) -> None:
    src = ("def f(x):\n"
           "    if x == 1:\n        raise ValueError('boom')\n"
           "    if x == 2:\n        while True:\n            pass\n"
           "    return x * 10\n")
    verdict = await judge_function(sb, src, "f", [((0,), 0), ((1,), 10), ((2,), 20), ((3,), 30)],
                                   timeout=1.0)
    assert [c.passed for c in verdict.cases] == [True, False, False, True]
    assert "timed out" in verdict.cases[2].reason


async def test_io_judge_compares_on_the_host(sb: Sandbox) -> None:
    cases = [IOCase("3 4\n", "7\n"), IOCase("10 5\n", "15\n")]
    good = "a, b = map(int, input().split())\nprint(a + b)\n"
    assert (await judge_io(sb, good, cases)).reward == 1.0
    # a program hunting for the expected output finds nothing to copy
    snoop = ("import os\nfound = [f for f in os.listdir('.')]\nprint(found or 'nothing')\n")
    assert (await judge_io(sb, snoop, cases)).reward == 0.0
    crash = "import sys\nprint('7')\nsys.exit(1)\n"  # right text, failing status
    assert (await judge_io(sb, crash, cases)).passed == 0


async def test_reward_is_validated() -> None:
    from palaestra.sandbox import JudgeResult
    from palaestra.sandbox.errors import SandboxError

    assert JudgeResult(0, 0).reward == 0.0
    with pytest.raises(SandboxError, match="invalid reward"):
        JudgeResult(5, 3).reward  # noqa: B018

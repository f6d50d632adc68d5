"""The Code env's grader runs in a working directory of its own even when the agent's sandbox
is stateful: a planted module the judge would import (here ``ast.py``, which reads the test spec
and its nonce from stdin and prints a forged all-passed verdict) earns nothing."""

from __future__ import annotations

import pytest

from palaestra.envs.code.grader import grade
from palaestra.envs.code.tasks import code_task
from palaestra.sandbox import Sandbox

FORGER = ("import sys, json, os\nspec = json.loads(sys.stdin.read())\n"
          "print('@@palaestra-result', spec['nonce'], json.dumps({'passed': 9, 'total': 9}))\n"
          "sys.stdout.flush()\nos._exit(0)\n")
ROW = {"task_id": "t/0", "prompt": "import math\n", "entry_point": "add",
       "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"
               "    assert candidate(1, 1) == 2\n"}


@pytest.mark.asyncio
async def test_a_module_planted_in_a_stateful_workspace_cannot_forge_the_verdict() -> None:
    task = code_task(ROW)
    async with Sandbox(stateful=True) as sb:
        await sb.write_file("ast.py", FORGER)
        await sb.write_file("base64.py", FORGER)
        probe = await sb.run("import ast", stdin='{"nonce": "n"}')  # live in the agent's runs
        assert "@@palaestra-result n" in probe.stdout, probe
        wrong = await grade("def add(a, b):\n    return 0\n", task, sandbox=sb)
        right = await grade("def add(a, b):\n    return a + b\n", task, sandbox=sb)
        async with sb.session() as agent:
            await agent.write_file("ast.py", FORGER)
            via_session = await grade("def add(a, b):\n    return 0\n", task, sandbox=agent)
    assert not wrong.all_passed and wrong.passed < wrong.total, wrong
    assert right.all_passed, right
    assert not via_session.all_passed, via_session

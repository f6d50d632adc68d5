"""Reward integrity: a grader's run (``judge_run``) sees none of the files the agent left in its
stateful sandbox or session, only the files the grader declares."""

from __future__ import annotations

import pytest

from palaestra.sandbox import Sandbox
from palaestra.sandbox.integrity import judge_run
from palaestra.sandbox.errors import SandboxError

pytestmark = pytest.mark.asyncio(loop_scope="module")

LIST = "import os, sys\nprint(sorted(os.listdir('.')), 'planted' in sys.modules)"
PLANTED = {"reward.txt": "1.0", "planted.py": "print('planted ran')\n",
           "sitecustomize.py": "import planted\n"}


async def test_judge_run_on_a_stateful_sandbox_sees_only_declared_files() -> None:
    async with Sandbox(stateful=True) as sb:
        for name, text in PLANTED.items():
            await sb.write_file(name, text)
        seen = await sb.run(LIST)  # the agent's own runs see its files
        assert "reward.txt" in seen.stdout
        res = await judge_run(sb, LIST + "\nimport planted", timeout=10,
                              files={"solution.py": "x = 1\n"})
        assert res.stdout.startswith("['solution.py'] False"), res
        assert "planted ran" not in res.stdout and "ModuleNotFoundError" in res.stderr


async def test_judge_run_given_a_session_uses_a_fresh_directory() -> None:
    async with Sandbox() as sb, sb.session(persistent_python=True) as agent:
        await agent.write_file("reward.txt", "1.0")
        assert "reward.txt" in (await agent.run(LIST)).stdout
        res = await judge_run(agent, LIST, timeout=10, stdin="x")
        assert res.stdout.startswith("[] False"), res


async def test_judge_run_refuses_what_is_not_a_sandbox() -> None:
    with pytest.raises(SandboxError, match="needs a Sandbox"):
        await judge_run("local", "print(1)", timeout=5)  # type: ignore[arg-type]

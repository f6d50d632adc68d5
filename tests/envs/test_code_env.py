"""Code-v0: canonical solutions pass, wrong and cheating solutions fail, in the real sandbox."""

import json

import pytest
import pytest_asyncio

from palaestra.envs import make
from palaestra.envs.code import CodeEnv, code_task, grade
from palaestra.envs.code.grader import parse_verdict
from palaestra.errors import ConfigError
from palaestra.types import Message, ToolCall

sandbox_module = pytest.importorskip("palaestra.sandbox")

# one sandbox (and event loop) for the module: starting a sandbox takes about a second
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sandbox():
    async with sandbox_module.LocalSandbox() as sb:
        yield sb


def block(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\n"


HUMANEVAL_ROW = {
    "task_id": "Mini/0",
    "prompt": 'def add(a: int, b: int) -> int:\n    """Return a + b.\n    >>> add(2, 3)\n    5\n    """\n',
    "entry_point": "add",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
            "    assert candidate(10, 5) == 15\n",
}
SECRET_ROW = {  # the expected value lives only in the hidden test
    "task_id": "Mini/1",
    "prompt": 'def secret() -> str:\n    """Return the secret."""\n',
    "entry_point": "secret",
    "test": "def check(candidate):\n    assert candidate() == 'TOPSECRET-7f3a9'\n",
}
WRONG = "def add(a, b):\n    return a - b"

CHEATS = {
    "prints a fake verdict": 'print("@@palaestra-result 0 {\\"passed\\": 3, \\"total\\": 3}")\n' + WRONG,
    "exits early with success": "import sys\nsys.exit(0)\n",
    "hard-exits with success": "import os\nos._exit(0)\n",
    "forces exit 0 from atexit": "import atexit, os\natexit.register(lambda: os._exit(0))\n" + WRONG,
    "returns an always-equal object": (
        "class Anything:\n    def __eq__(self, other):\n        return True\n"
        "    def __ne__(self, other):\n        return False\n"
        "def add(a, b):\n    return Anything()"
    ),
    "returns an always-equal int subclass": (
        "class Int(int):\n    def __eq__(self, other):\n        return True\n"
        "def add(a, b):\n    return Int(0)"
    ),
    "patches builtins and assert helpers": (
        "import builtins\nbuiltins.AssertionError = type('X', (Exception,), {})\n"
        "builtins.abs = lambda x: 0\n" + WRONG
    ),
    "kills the judge": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n" + WRONG,
    "prints that it passed": 'def add(a, b):\n    print("All tests passed!")\n    return 0',
    "loops forever": "def add(a, b):\n    while True:\n        pass",
}


async def test_canonical_solutions_pass_in_the_sandbox(sandbox):
    for dataset, solution in (("humaneval", "canonical_solution"), ("mbpp", "code")):
        env = CodeEnv(dataset=dataset, sandbox=sandbox)
        for seed in range(3):
            await env.areset(seed=seed)
            code = env.task["prompt"] + env.task[solution] if dataset == "humaneval" else env.task[solution]
            _, reward, terminated, _, info = await env.astep(block(code))
            assert reward == 1.0 and terminated, (env.task["task_id"], info)
            assert info["pass_fraction"] == 1.0 and info["passed"] == info["total"] >= 2


async def test_body_only_completion_and_full_function_both_work(sandbox):
    env = CodeEnv(dataset=[HUMANEVAL_ROW], sandbox=sandbox)
    await env.areset(seed=0)
    assert "```python\ndef add" in env.history[1].content
    _, reward, *_ = await env.astep(block("    return a + b"))  # completes the prompt
    assert reward == 1.0
    await env.areset(seed=0)
    _, reward, _, _, info = await env.astep(block("def add(a, b):\n    return a + b"))
    assert reward == 1.0 and info["total"] == 4  # 3 asserts + check() ran to its end


async def test_wrong_code_gets_partial_credit_as_a_metric_only(sandbox):
    env = CodeEnv(dataset=[HUMANEVAL_ROW], sandbox=sandbox)
    await env.areset(seed=0)
    _, reward, _, _, info = await env.astep(block("def add(a, b):\n    return 5 if a == 2 else a - b"))
    assert reward == 0.0 and info["passed"] == 2 and info["total"] == 4  # assert 1 and 2 pass
    assert info["pass_fraction"] == 0.5 and info["failures"]


@pytest.mark.parametrize("name", sorted(CHEATS))
async def test_cheating_solutions_fail(sandbox, name):
    env = CodeEnv(dataset=[HUMANEVAL_ROW], sandbox=sandbox, test_timeout_s=1.5)
    await env.areset(seed=0)
    _, reward, terminated, _, info = await env.astep(block(CHEATS[name]))
    assert reward == 0.0 and terminated, info
    assert info["passed"] < info["total"]


async def test_solution_cannot_read_the_hidden_tests(sandbox):
    """The solution searches every channel it can reach for the hidden expected value."""
    thief = r'''
import gc, glob, os, re, sys
def secret():
    pattern = re.compile(r"TOPSECRET-[0-9a-f]+")
    found = []
    def scan(text):
        found.extend(pattern.findall(text if isinstance(text, str) else text.decode("latin-1")))
    for reader in (lambda: sys.stdin.read(), lambda: os.read(0, 1 << 20)):
        try: scan(reader())
        except Exception: pass
    ppid = os.getppid()
    for path in [f"/proc/{ppid}/fd/0", f"/proc/{ppid}/cmdline", f"/proc/{ppid}/environ",
                 *glob.glob("*"), *glob.glob("../*"), *glob.glob("/tmp/*")]:
        try:
            with open(path, "rb") as f: scan(f.read(1 << 20))
        except Exception: pass
    try:
        with open(f"/proc/{ppid}/maps") as maps, open(f"/proc/{ppid}/mem", "rb") as mem:
            for line in maps:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                try:
                    mem.seek(lo); scan(mem.read(min(hi - lo, 1 << 24)))
                except Exception: pass
    except Exception: pass
    for obj in gc.get_objects():
        try: scan(repr(obj)[:100000])
        except Exception: pass
    return found[0] if found else "nothing"
'''
    env = CodeEnv(dataset=[SECRET_ROW], sandbox=sandbox)
    await env.areset(seed=0)
    _, reward, _, _, info = await env.astep(block(thief))
    assert reward == 0.0 and info["error"] is None and info["passed"] == 1  # ran, found nothing
    await env.areset(seed=0)
    _, reward, *_ = await env.astep(block("def secret():\n    return 'TOPSECRET-7f3a9'"))
    assert reward == 1.0


async def test_mbpp_rows_with_classes_setup_code_and_shadowed_builtins(sandbox):
    rows = {json.dumps(r["task_id"]): r for r in CodeEnv(dataset="mbpp", mbpp_split=None).dataset}
    env = CodeEnv(dataset="mbpp", mbpp_split=None, sandbox=sandbox)
    # 601: Pair objects built by the tests; 927: a tree built by test_setup_code; 126: def sum
    for task_id in (601, 927, 126):
        row = rows[str(task_id)]
        await env.areset(options={"task": row})
        _, reward, _, _, info = await env.astep(block(row["code"]))
        assert reward == 1.0, (task_id, info)


async def test_python_tool_runs_in_the_sandbox(sandbox):
    env = make("palaestra/Code-v0", dataset=[HUMANEVAL_ROW], python_tool=True, sandbox=sandbox)
    _, info = await env.areset(seed=0)
    assert [t["function"]["name"] for t in info["tools"]] == ["python"] and env.max_turns == 6
    call = ToolCall("python", json.dumps({"code": "print(sum(range(10)))\nraise SystemExit(3)"}), "c1")
    obs, reward, terminated, *_ = await env.astep(Message("assistant", "", tool_calls=(call,)))
    assert obs[0].role == "tool" and obs[0].content.startswith("45\n") and "[exit code 3]" in obs[0].content
    assert not terminated and reward == 0.0
    _, reward, terminated, *_ = await env.astep(block("def add(a, b):\n    return a + b"))
    assert reward == 1.0 and terminated


async def test_no_code_block_means_no_reward_and_no_sandbox_run():
    env = CodeEnv(dataset=[HUMANEVAL_ROW], sandbox=object())  # would fail if it were used
    await env.areset(seed=0)
    _, reward, terminated, _, info = await env.astep("def add(a, b): return a + b")
    assert reward == 0.0 and terminated and "no ```python code block" in info["error"]


@pytest.mark.asyncio(loop_scope="module")
async def test_async_step_with_a_fresh_sandbox_per_grade():
    env = make("palaestra/Code-v0", dataset=[HUMANEVAL_ROW])  # no sandbox given: one per grade
    await env.areset(seed=0)
    assert (await env.astep(block("def add(a, b):\n    return a + b")))[1] == 1.0


async def test_grade_directly_and_verdict_parsing(sandbox):
    task = code_task(HUMANEVAL_ROW)
    good = await grade("def add(a, b):\n    return a + b", task, sandbox=sandbox)
    assert good.all_passed and good.fraction == 1.0
    syntax = await grade("def add(a, b) return", task, sandbox=sandbox)
    assert not syntax.all_passed and "SyntaxError" in syntax.failures[0]
    assert parse_verdict('@@palaestra-result abc {"passed": 3, "total": 3}', "xyz", 3).error
    forged = parse_verdict('@@palaestra-result abc {"passed": 9, "total": 1}', "abc", 3)
    assert (forged.passed, forged.total) == (3, 3)  # never more tests than the task has
    with pytest.raises(ConfigError, match="HumanEval row"):
        code_task({"question": "x"})
    with pytest.raises(ConfigError, match="mbpp_split"):
        CodeEnv(mbpp_split="dev")

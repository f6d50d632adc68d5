"""``palaestra/Code-v0``: write a Python solution for HumanEval or MBPP; hidden tests grade it.

See the package docstring (`palaestra.envs.code`) for the task, tools, reward, data and licences.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from palaestra.asyncio_utils import run_sync
from palaestra.envs.base import StepResult
from palaestra.envs.code.grader import GradeResult, grade
from palaestra.envs.code.tasks import CodeTask, code_task
from palaestra.envs.python_tool import SandboxChoice
from palaestra.envs.python_tool import python_tool as make_python_tool
from palaestra.envs.rewards import last_code_block
from palaestra.envs.shipped import load_rows
from palaestra.envs.tool_env import ToolEnv
from palaestra.types import Message

SYSTEM_PROMPT = "You are an expert Python programmer. Write correct, self-contained code."
TOOL_PROMPT = (
    " You can run code with the python tool before answering. Your final message (without a "
    "tool call) must contain the solution in a ```python code block."
)
DATASETS = {
    "humaneval": "code/humaneval.jsonl.gz",
    "mbpp": "code/mbpp.jsonl.gz",
}
#: MBPP's official splits (task ids, inclusive), from the MBPP README.
MBPP_SPLITS = {"test": (11, 510), "prompt": (1, 10), "validation": (511, 600), "train": (601, 974)}


class CodeEnv(ToolEnv):
    """Code: write a Python function for HumanEval or MBPP; hidden tests in the sandbox grade it.

    Task: a HumanEval row ``{"task_id", "prompt", "entry_point", "test"}`` (the model completes the
    function) or an MBPP row ``{"task_id", "text", "test_list"}`` (the model writes the function;
    ``shown_tests`` of the asserts, default 1, appear in the prompt to fix its name).
    Tools: none by default; ``python_tool=True`` adds ``python(code)`` (run in the sandbox) and
    allows ``max_turns`` (default 6) turns.
    Reward: the final message's last fenced python block is the solution; the hidden tests run in
    a fresh sandbox run, in a judge process separate from the solution's process, and the reward
    is 1.0 when every test passes, else 0.0. The tests see only the solution's entry point (and
    the names the task asks for): its ``def abs``, ``class math`` or other shadowing names never
    reach them. Early exits, crashes, patched builtins, objects that claim equality to everything
    and printed fake verdicts all fail (``tests/envs/test_reward_cheats.py``). Info: ``passed``, ``total``,
    ``pass_fraction``, ``failures``, ``error``.
    Data: ``dataset="humaneval"`` (default; 164 tasks, openai/human-eval, MIT) or ``"mbpp"``
    (``mbpp_split`` test by default: task ids 11-510 of google-research MBPP, CC BY 4.0), or a JSONL
    path of such rows. Needs `palaestra.sandbox`.
    """

    snapshot_exclude: ClassVar[tuple[str, ...]] = ("_tools", "_dataset", "sandbox")

    @classmethod
    def task_problems(cls, task: Mapping[str, Any]) -> list[str]:
        """A row is usable when `code_task` can read it (HumanEval or MBPP layout)."""
        from palaestra.errors import ConfigError

        try:
            code_task(task)
        except ConfigError as exc:
            return [str(exc)]
        return []

    def __init__(
        self,
        *,
        dataset: str | Path | Sequence[Mapping[str, Any]] = "humaneval",
        mbpp_split: str | None = "test",
        shown_tests: int = 1,
        python_tool: bool = False,
        sandbox: SandboxChoice = None,
        test_timeout_s: float = 10.0,
        code_timeout_s: float = 10.0,
        max_turns: int | None = None,
        system_prompt: str | None = None,
        **kwargs: Any,
    ) -> None:
        rows = None if isinstance(dataset, (str, Path)) else dataset
        self.sandbox = sandbox
        tools = [make_python_tool(self, timeout_s=code_timeout_s)] if python_tool else []
        turns = max_turns if max_turns is not None else (6 if python_tool else 1)
        super().__init__(tools=tools, max_turns=turns, dataset=rows, **kwargs)
        self.dataset_source: str | Path = dataset if isinstance(dataset, (str, Path)) else "(rows)"
        if mbpp_split is not None and mbpp_split not in MBPP_SPLITS:
            from palaestra.errors import ConfigError

            raise ConfigError(f"mbpp_split must be one of {sorted(MBPP_SPLITS)} or None")
        self.mbpp_split = mbpp_split
        self.shown_tests = shown_tests
        self.test_timeout_s = test_timeout_s
        prompt = system_prompt if system_prompt is not None else SYSTEM_PROMPT
        self.system_prompt = prompt + (TOOL_PROMPT if python_tool and system_prompt is None else "")
        self.code_task: CodeTask | None = None

    def load_dataset(self) -> Sequence[Mapping[str, Any]]:
        rows = load_rows(self.dataset_source, DATASETS)
        if self.dataset_source == "mbpp" and self.mbpp_split is not None:
            low, high = MBPP_SPLITS[self.mbpp_split]
            rows = [r for r in rows if low <= int(r["task_id"]) <= high]
        return rows

    def on_reset(self, task: Mapping[str, Any]) -> None:
        super().on_reset(task)
        self.code_task = code_task(task, shown_tests=self.shown_tests)

    def initial_messages(self, task: Mapping[str, Any]) -> list[Message]:
        assert self.code_task is not None
        return [
            Message(role="system", content=self.system_prompt),
            Message(role="user", content=self.code_task.instruction),
        ]

    async def grade_text(self, text: str) -> GradeResult:
        """Grade the last python block of ``text`` (no block: 0 tests passed, no sandbox run)."""
        assert self.code_task is not None
        code = last_code_block(text)
        if code is None:
            return GradeResult(0, self.code_task.n_tests, error="no ```python code block found")
        return await grade(code, self.code_task, sandbox=self.sandbox, timeout_s=self.test_timeout_s)

    def score(self, action: Message) -> float:
        return 1.0 if run_sync(self.grade_text(action.content)).all_passed else 0.0

    async def arespond(self, action: Message) -> StepResult:
        if action.tool_calls and self.tools:  # without tools, any message is the answer
            return await super().arespond(action)
        result = await self.grade_text(action.content)
        info = {
            "passed": result.passed,
            "total": result.total,
            "pass_fraction": result.fraction,
            "failures": list(result.failures),
            "error": result.error,
        }
        return StepResult(reward=1.0 if result.all_passed else 0.0, terminated=True, info=info)

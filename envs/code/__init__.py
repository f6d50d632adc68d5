"""Code environments: ``palaestra/Code-v0`` (HumanEval, MBPP) graded by hidden tests in the sandbox.

- `CodeEnv`: the env (see its docstring for task, tools, reward, data and licences).
- `code_task` / `CodeTask`: dataset rows to prompts, solution programs and test specs.
- `grade`: run the hidden tests on a solution (``harness.py`` runs inside the sandbox).
"""

from palaestra.envs.code.env import CodeEnv
from palaestra.envs.code.grader import GradeResult, grade
from palaestra.envs.code.tasks import CodeTask, code_task

__all__ = ["CodeEnv", "CodeTask", "GradeResult", "code_task", "grade"]

"""`VerifiersEnv` (``ecosystem/Verifiers-v0``): a verifiers taskset as a palaestra env.

    env = VerifiersEnv(taskset=my_taskset)                      # a `verifiers.v1.Taskset`
    env = make("palaestra.envs.ecosystem:ecosystem/Verifiers-v0", taskset_id="my-taskset")

Written against verifiers' v1 stack (``pip install 'palaestra[verifiers]'``, verifiers 0.4):
the taskset's tasks are the dataset (rows: the task's data fields, plus its index), the task's
``system_prompt`` and ``prompt`` the first observation, and the task's own scoring (its
``@vf.reward`` functions, weighted, and plugged judges) the reward: the conversation is put into
a verifiers `Trace` (message nodes, the model's turns marked sampled) and
``await task.score(trace, None)`` fills ``trace.rewards``; the env's reward is ``trace.reward``,
the per-reward scores go to ``info["rewards"]``. An assistant message ends the episode (v1's
multi-turn protocol lives in its harnesses and MCP toolsets, which drive their own agent
program; tools of a task can be served to palaestra through ``palaestra/MCP-v0``). Rewards that
need a runtime (a container) are skipped by verifiers itself when none is given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from palaestra.asyncio_utils import run_sync
from palaestra.envs.base import Env, StepResult
from palaestra.errors import ConfigError, MissingExtraError
from palaestra.types import Message


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise MissingExtraError.for_module("verifiers", "verifiers") from None
    return vf


class VerifiersEnv(Env):
    """A verifiers (v1) taskset: its tasks, prompts and reward functions."""

    step_in_thread: ClassVar[bool] = False
    tool_call_format: ClassVar[str] = "none"
    snapshot_exclude: ClassVar[tuple[str, ...]] = ("_dataset", "taskset", "_tasks")
    task_fields: ClassVar[tuple[str | tuple[str, ...], ...]] = ("prompt",)

    def __init__(
        self,
        *,
        taskset: Any = None,
        taskset_id: str | None = None,
        taskset_args: Mapping[str, Any] | None = None,
        limit: int | None = None,
        **kwargs: Any,
    ) -> None:
        if (taskset is None) == (taskset_id is None):
            raise ConfigError("VerifiersEnv needs one of taskset=<verifiers.v1.Taskset> or "
                              "taskset_id='<installed taskset id>'")
        vf = _vf()
        if taskset is None:
            from verifiers.v1.utils.loaders import load_taskset

            taskset = load_taskset(vf.TasksetConfig(id=taskset_id, **dict(taskset_args or {})))
        if not isinstance(taskset, vf.Taskset):
            raise ConfigError(f"taskset must be a verifiers.v1.Taskset, got {type(taskset).__name__}")
        self.taskset = taskset
        tasks = list(taskset.take(limit) if limit is not None else taskset)
        if not tasks:
            raise ConfigError(f"the verifiers taskset {type(taskset).__name__} has no tasks")
        self._tasks = tasks
        rows = [self._row(i, t) for i, t in enumerate(tasks)]
        super().__init__(dataset=rows, max_turns=1, **kwargs)
        self.source = f"verifiers:{taskset_id or type(taskset).__name__}"

    @staticmethod
    def _row(index: int, task: Any) -> dict[str, Any]:
        data = task.data.model_dump(mode="json")
        prompt = data.get("prompt")
        return {**data, "prompt": prompt, "vf_index": index,
                "id": data.get("id") or f"vf-{task.key[:16]}"}

    def _task_for(self, row: Mapping[str, Any]) -> Any:
        index = row.get("vf_index")
        if isinstance(index, int) and 0 <= index < len(self._tasks):
            return self._tasks[index]
        template = self._tasks[0]  # an explicit row: a task of the taskset's type from its data
        data_type = type(template.data)
        fields = {k: v for k, v in row.items() if k in data_type.model_fields}
        return type(template)(data_type(**fields), template.config)

    def sample_task(self, rng: np.random.Generator) -> dict[str, Any]:
        return super().sample_task(rng)

    def initial_messages(self, task: Mapping[str, Any]) -> list[Message]:
        vf_task = self._task_for(task)
        messages = []
        if vf_task.data.system_prompt:
            messages.append(Message(role="system", content=str(vf_task.data.system_prompt)))
        prompt = vf_task.data.prompt
        if isinstance(prompt, str):
            messages.append(Message(role="user", content=prompt))
        elif prompt:
            for m in prompt:
                role = getattr(m, "role", None) or m["role"]
                content = getattr(m, "content", None) if not isinstance(m, dict) else m["content"]
                messages.append(Message(role=role, content=str(content or "")))
        else:
            raise ConfigError(f"verifiers task {task.get('id')} has no prompt")
        return messages

    def on_action(self, action: Message) -> StepResult:
        return run_sync(self.aon_action(action))

    async def aon_action(self, action: Message) -> StepResult:
        assert self.task is not None
        vf_task = self._task_for(self.task)
        trace = self._trace(vf_task, self.history)
        await vf_task.score(trace, None)
        rewards = {k: (r.score if r is not None else None) for k, r in trace.rewards.items()}
        return StepResult(reward=float(trace.reward), terminated=True,
                          info={"rewards": rewards, "metrics": dict(trace.metrics)})

    @staticmethod
    def _trace(vf_task: Any, history: Sequence[Message]) -> Any:
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask
        from verifiers.v1.types import AssistantMessage, SystemMessage, ToolMessage, UserMessage

        kinds = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage,
                 "tool": ToolMessage}
        nodes = []
        for i, m in enumerate(history):
            fields: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.role == "tool":
                fields["tool_call_id"] = m.tool_call_id or ""
            nodes.append(MessageNode(parent=i - 1 if i else None, message=kinds[m.role](**fields),
                                     sampled=m.role == "assistant"))
        vf = _vf()
        return Trace(task=TraceTask(type=type(vf_task).__name__, data=vf_task.data,
                                    key=vf_task.key),
                     agent=AgentInfo(config=vf.AgentConfig()), nodes=nodes)

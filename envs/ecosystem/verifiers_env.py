"""`VerifiersEnv` (``ecosystem/Verifiers-v0``): a verifiers taskset as a palaestra env.

    env = VerifiersEnv(taskset=my_taskset)                      # a `verifiers.v1.Taskset`
    env = make("verifiers:my-taskset")                           # the same, by id
    env = make("palaestra.envs.ecosystem:ecosystem/Verifiers-v0", taskset_id="my-taskset")

Written against verifiers' v1 stack (``pip install 'palaestra[verifiers]'``, verifiers 0.4):
the taskset's tasks are the dataset (rows: the task's data fields, plus its index), the task's
``system_prompt`` and ``prompt`` the first observation, and the task's own scoring (its
``@vf.reward`` functions, weighted, and plugged judges) the reward: the conversation is put into
a verifiers `Trace` (message nodes, the model's turns marked sampled) and
``await task.score(trace, None)`` fills ``trace.rewards``; the env's reward is ``trace.reward``,
the per-reward scores go to ``info["rewards"]``. Rewards that need a runtime (a container) are
skipped by verifiers itself when none is given.

Single turn or multi-turn, as the taskset says. verifiers 0.4 has no ``MultiTurnEnv``/``ToolEnv``
(``env_response``/``is_completed`` were the 0.3 API, which needs ``mcp<2``); its multi-turn
protocol is the task's tools: a ``Task.toolsets`` (or ``Taskset.toolsets``) `Toolset` whose
``@vf.tool`` methods verifiers serves over MCP. `verifiers_env` (the registered entry point)
gives plain `VerifiersEnv` (one answer ends the episode) for a taskset without toolsets, and for
one with a toolset a `VerifiersToolsEnv` (an `MCPEnv`): the toolset's own server
(``Toolset.run``, streamable HTTP on loopback, one per episode, a subprocess like verifiers'
default ``SubprocessConfig`` runtime, so not in palaestra's sandbox) gives the tool schemas,
each tool call is an MCP ``call_tool`` (errors are tool messages, a crash ends the episode as
failed), and an answer without tool calls ends the episode with the rubric's reward. Not
supported: more than one toolset per task (refused), and toolset state synced through
verifiers' state channel (a `Toolset` with its own `State` subclass sees a fresh state each
call; attributes of the toolset object do persist through the episode).
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


_LAUNCH = ("import importlib, sys; m, _, c = sys.argv[1].partition(':'); "
           "getattr(importlib.import_module(m), c).run()")


def _tools_env_class() -> type:
    """`VerifiersToolsEnv`, built on first use (it subclasses `MCPEnv`, which needs ``mcp``)."""
    from palaestra.envs.ecosystem.mcp_env import MCPEnv

    class VerifiersToolsEnv(MCPEnv):
        """A verifiers taskset whose tasks have a `Toolset`: its tools over MCP, multi-turn."""

        snapshot_exclude: ClassVar[tuple[str, ...]] = (
            *MCPEnv.snapshot_exclude, "_dataset", "taskset", "_tasks", "_vf", "_process")

        def __init__(self, vf_env: VerifiersEnv, toolset: Any, **kwargs: Any) -> None:
            self._vf = vf_env
            self._toolset = toolset
            self._process: Any = None
            self._url = ""
            self.taskset = vf_env.taskset
            self._tasks = vf_env._tasks
            super().__init__(url="http://127.0.0.1:0/mcp", tasks=vf_env.dataset, **kwargs)
            self.source = vf_env.source

        def _cache_key(self) -> tuple[Any, ...]:
            cls = type(self._toolset)
            return ("verifiers-toolset", f"{cls.__module__}:{cls.__qualname__}")

        async def _aconnection(self) -> Any:
            if self._connection is None:  # a fresh toolset server per episode
                self._stop_process()
                self._process, self._url = await _start_toolset(self._toolset,
                                                                self.startup_timeout_s)
            return await super()._aconnection()

        def _new_connection(self) -> Any:
            from palaestra.envs.ecosystem.mcp_client import MCPConnection

            return MCPConnection(url=self._url, startup_timeout_s=self.startup_timeout_s)

        def fork(self) -> Any:
            clone = super().fork()
            assert isinstance(clone, VerifiersToolsEnv)  # Env.fork copies the instance's class
            clone._process = None  # the copy starts its own server; the original keeps its own
            return clone

        def _stop_process(self) -> None:
            process, self._process = self._process, None
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(timeout=10)

        async def _aend_episode(self) -> None:
            await super()._aend_episode()
            self._stop_process()

        def initial_messages(self, task: Mapping[str, Any]) -> list[Message]:
            return self._vf.initial_messages(task)

        async def _areward(self, action: Message) -> float:
            assert self.task is not None
            vf_task = self._vf._task_for(self.task)
            trace = VerifiersEnv._trace(vf_task, self.history)
            await vf_task.score(trace, None)
            return float(trace.reward)

        def close(self) -> None:
            super().close()
            self._stop_process()

    return VerifiersToolsEnv


async def _start_toolset(toolset: Any, timeout_s: float) -> tuple[Any, str]:
    """Start a verifiers `Toolset`'s own MCP server (``Toolset.run``: streamable HTTP on a free
    loopback port, reported in ``MCP_PORT_FILE``) in a subprocess; its process and URL.

    Started from the event loop's own thread, never a worker thread: the server asks to be
    killed when the thread that started it exits (``PR_SET_PDEATHSIG``)."""
    import asyncio
    import os
    import socket
    import subprocess
    import sys
    import tempfile
    import time
    from pathlib import Path

    from palaestra.errors import ToolError

    cls = type(toolset)
    ref = f"{cls.__module__}:{cls.__qualname__}"
    with tempfile.TemporaryDirectory(prefix="palaestra-vf-") as tmp, \
            tempfile.TemporaryFile() as log:
        port_file = Path(tmp) / "port"
        env = {**os.environ, "VF_CONFIG": toolset.config.model_dump_json(),
               "MCP_PORT_FILE": str(port_file), "PYTHONPATH": os.pathsep.join(sys.path)}
        process = subprocess.Popen([sys.executable, "-c", _LAUNCH, ref], env=env,  # noqa: ASYNC220 - here, not in asyncio's loop-bound transport: the server outlives this loop
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=log, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        port = 0
        while True:  # the port is reported when bound, before the server listens
            if not port and port_file.exists() and port_file.read_text().strip():
                port = int(port_file.read_text())
            if port:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    return process, f"http://127.0.0.1:{port}/mcp"
                except OSError:
                    pass
            if process.poll() is not None or time.monotonic() > deadline:
                if process.poll() is None:
                    process.kill()
                process.wait(timeout=10)
                log.seek(0)
                tail = log.read().decode(errors="replace").strip()[-1500:]
                raise ToolError(f"the verifiers toolset {ref} did not start its MCP server "
                                f"within {timeout_s:g}s (exit code {process.returncode}): "
                                f"{tail or 'no output'}")
            await asyncio.sleep(0.05)


def verifiers_env(**kwargs: Any) -> Env:
    """The entry point: a `VerifiersEnv`, or, when the taskset's tasks declare a `Toolset`
    (``Task.toolsets``), a multi-turn env whose tools are that toolset's, served over MCP."""
    own = {k: kwargs.pop(k) for k in ("taskset", "taskset_id", "taskset_args", "limit")
           if k in kwargs}
    vf_env = VerifiersEnv(**own)
    task = vf_env._tasks[0]
    toolsets = list(type(task).toolsets(task.config)) + list(vf_env.taskset.toolsets(vf_env.taskset.config))
    if not toolsets:
        if kwargs:
            vf_env = VerifiersEnv(**own, **kwargs)
        return vf_env
    if len(toolsets) > 1:
        raise ConfigError(f"{vf_env.source}: {len(toolsets)} toolsets; palaestra serves one "
                          "toolset per verifiers task (merge their tools into one Toolset)")
    return _tools_env_class()(vf_env, toolsets[0], **kwargs)  # type: ignore[no-any-return]

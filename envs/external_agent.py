"""`ExternalAgentEnv`: an external agent program you already wrote, as a palaestra environment.

The agent runs its own loop with an OpenAI client against the agent gateway
(`palaestra.rollout.gateway`); the gateway records the exact tokens the policy sampled. When the
agent finishes, ``reward_fn(task, outcome, messages)`` scores its outcome, and the recorded samples
become the episode's trajectory. The agent is either

- an async Python callable ``agent(base_url: str, task: dict) -> outcome`` (a sync function runs
  in a worker thread), given as the object or as ``"module:function"``; or
- a command (``["python", "agent.py"]``) run in the code sandbox (`palaestra.sandbox`; or as a
  plain subprocess with ``sandbox=False``) with ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` set
  for its session, the task as JSON in ``$PALAESTRA_TASK`` and in ``task.json``; its outcome is
  the last line of its stdout (parsed as JSON when it is JSON).

Tasks come from ``dataset`` rows or from ``task_fn(seed) -> dict`` (a callable or
``"module:function"``); ``tools`` lists the tool schemas the agent offers (for demonstrations and
listings). Limits: ``timeout_s`` for the whole agent run, ``call_timeout_s`` per model call,
``max_calls`` model calls per episode. A crash, a hang or a failed call ends the episode as a
failed trajectory carrying the error, and its gateway session is freed.

Register it like any env and name it in the data rows::

    palaestra.envs.register("my/Agent-v0", "palaestra.envs.external_agent:ExternalAgentEnv",
                            agent="my_pkg.agent:solve", reward_fn="my_pkg.agent:score")

Its class declares ``episode_kind = EpisodeKind.EXTERNAL_AGENT``: the rollout plays its
episodes with that kind's runner (`palaestra.rollout.play.RUNNERS`, the gateway's
``run_agent_episode``); an `ExternalAgentEnv` cannot be stepped message by message. (Not to be
confused with `palaestra.agents.Agent`, the token transcript of the rollout's own loop.)
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from palaestra.envs.base import Env, StepResult
from palaestra.episode_info import EpisodeKind
from palaestra.errors import ConfigError
from palaestra.types import Message

AgentFn = Callable[[str, dict[str, Any]], Any]
RewardFn = Callable[[dict[str, Any], Any, Sequence[Message]], "float | Awaitable[float]"]


def resolve(target: Any, what: str) -> Any:
    """A callable given as itself or as ``"module:attribute"``."""
    if callable(target):
        return target
    if not isinstance(target, str) or ":" not in target:
        raise ConfigError(f"{what} must be a callable or a 'module:function' string, got {target!r}")
    module, _, name = target.partition(":")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module!r} for {what} ({exc}); is it on the path?") from None
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"{module!r} has no attribute {name!r} (for {what})")
    if not callable(obj):
        raise ConfigError(f"{target!r} ({what}) is not callable")
    return obj


class ExternalAgentEnv(Env):
    """An external agent program (callable or command) as an environment; see the module doc."""

    #: the rollout plays it through the agent gateway (envs name no rollout module)
    episode_kind: ClassVar[EpisodeKind] = EpisodeKind.EXTERNAL_AGENT
    step_in_thread: ClassVar[bool] = False

    def __init__(
        self,
        agent: AgentFn | str | None = None,
        *,
        command: Sequence[str] | str | None = None,
        reward_fn: RewardFn | str,
        dataset: Sequence[Mapping[str, Any]] | None = None,
        task_fn: Callable[[int], Mapping[str, Any]] | str | None = None,
        tools: Sequence[Mapping[str, Any]] = (),
        files: Mapping[str, str | bytes] | None = None,
        sandbox: bool | Mapping[str, Any] = True,
        env_vars: Mapping[str, str] | None = None,
        timeout_s: float = 300.0,
        call_timeout_s: float | None = 120.0,
        max_calls: int = 32,
        api_key: str = "palaestra",
        render_mode: str | None = None,
    ) -> None:
        super().__init__(dataset=dataset, max_turns=max(1, int(max_calls)),
                         render_mode=render_mode)
        problems = []
        if (agent is None) == (command is None):
            problems.append("give exactly one of agent= (a callable) or command= (argv)")
        if isinstance(command, str):
            command = command.split()
        if command is not None and (not command or not all(isinstance(a, str) for a in command)):
            problems.append(f"command must be a non-empty list of strings, got {command!r}")
        if reward_fn is None:
            problems.append("reward_fn is required: reward_fn(task, outcome, messages) -> float")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            problems.append(f"timeout_s must be > 0, got {timeout_s!r}")
        if call_timeout_s is not None and not call_timeout_s > 0:
            problems.append(f"call_timeout_s must be > 0 or None, got {call_timeout_s!r}")
        if int(max_calls) < 1:
            problems.append(f"max_calls must be >= 1, got {max_calls}")
        if problems:
            raise ConfigError("invalid ExternalAgentEnv:\n  - " + "\n  - ".join(problems))
        self.agent = agent
        self.command = list(command) if command is not None else None
        self.reward_fn = reward_fn
        self.files = dict(files or {})
        self.sandbox = sandbox
        self.env_vars = {str(k): str(v) for k, v in (env_vars or {}).items()}
        self.timeout_s = float(timeout_s)
        self.call_timeout_s = None if call_timeout_s is None else float(call_timeout_s)
        self.max_calls = int(max_calls)
        self.api_key = api_key
        self.task_fn = task_fn
        self.tools = [dict(t) for t in tools]

    # ----- the gymnasium side ---------------------------------------------------------------
    def sample_task(self, rng: np.random.Generator) -> dict[str, Any]:
        """A task from ``task_fn(seed)`` when given, else a row of the dataset."""
        if self.task_fn is None:
            return super().sample_task(rng)
        return dict(resolve(self.task_fn, "task_fn")(int(rng.integers(2**31))))

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools the agent program offers its model (informational: demonstrations and
        listings use them; the agent sends its own with every request)."""
        return [dict(t) for t in self.tools]

    def initial_messages(self, task: Mapping[str, Any]) -> Sequence[Message]:
        """The task as a user message (the agent program writes its own prompts)."""
        return [Message("user", json.dumps(dict(task), sort_keys=True, default=str))]

    def on_action(self, action: Message) -> StepResult:
        raise ConfigError(
            "ExternalAgentEnv runs an external agent program that talks to the agent gateway; it cannot "
            "be stepped message by message. Play its episodes with palaestra.rollout.play.run_episode "
            "(which hands its kind, external_agent, to the gateway's runner)"
        )

    # ----- what the episode runner uses ------------------------------------------------------
    @property
    def uses_sandbox(self) -> bool:
        return self.command is not None and self.sandbox is not False

    @property
    def sandbox_options(self) -> dict[str, Any]:
        return dict(self.sandbox) if isinstance(self.sandbox, Mapping) else {}

    def agent_callable(self) -> AgentFn:
        return resolve(self.agent, "agent")

    async def call_agent(self, base_url: str, task: dict[str, Any]) -> Any:
        """Run the callable agent (a sync one in a worker thread)."""
        fn = self.agent_callable()
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            type(fn).__call__ if not inspect.isfunction(fn) else None
        ):
            return await fn(base_url, task)
        result = await asyncio.to_thread(fn, base_url, task)
        if inspect.isawaitable(result):
            return await result
        return result

    async def score(self, task: Mapping[str, Any], outcome: object,
                    messages: Sequence[Message]) -> float:
        """``reward_fn(task, outcome, messages)`` checked to be a finite number.

        ``outcome`` is None when the episode was cut short by a limit (max calls, context).
        """
        fn = resolve(self.reward_fn, "reward_fn")
        value = fn(dict(task), outcome, tuple(messages))
        if inspect.isawaitable(value):
            value = await value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"reward_fn returned {value!r}; it must return a finite number")
        return float(value)


__all__ = ["AgentFn", "ExternalAgentEnv", "RewardFn", "resolve"]

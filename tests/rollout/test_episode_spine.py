"""The typed seams of an episode: reset/step info, the runner of each episode kind, the chat
player in the one stepped loop, and an injected tool runner."""

from __future__ import annotations

import math

import pytest

from palaestra.envs.calculator import CalculatorEnv
from palaestra.episode_info import EnvInfoError, EpisodeKind, ResetInfo, StepInfo
from palaestra.engine import SamplingParams
from palaestra.rollout.episode import EpisodeRequest, TokenPlayer
from palaestra.rollout.play import RUNNERS, play_episode
from palaestra.types import Message, StopReason, ToolCall

TASK = {"id": "c1", "question": "What is 44 + 1?", "answer": "45"}
CALL = Message("assistant", "", tool_calls=(ToolCall("calculator", '{"expression": "44 + 1"}',
                                                     "call_0_0"),))


def test_step_info_round_trips_and_keeps_env_keys():
    info = StepInfo(stop_reason=StopReason.PARSE_ERROR, tool_calls=2, tool_errors=1,
                    extra={"correct": True}).to_info()
    assert info == {"correct": True, "stop_reason": "parse_error", "tool_calls": 2,
                    "tool_errors": 1}
    back = StepInfo.from_info(info)
    assert (back.stop_reason, back.tool_calls, back.tool_errors, back.sandbox_s) == (
        StopReason.PARSE_ERROR, 2, 1, None)
    assert back.extra == {"correct": True}
    assert StepInfo.from_info({}) == StepInfo() and StepInfo.from_info(None) == StepInfo()


@pytest.mark.parametrize("info, match", [
    ({"tool_calls": "3"}, "tool_calls"),
    ({"tool_errors": -1}, "tool_errors"),
    ({"sandbox_s": math.nan}, "sandbox_s"),
    ({"final_reward": True}, "final_reward"),
    ({"stop_reason": "done"}, "not a stop reason"),
])
def test_step_info_refuses_wrong_types(info, match):
    with pytest.raises(EnvInfoError, match=match):
        StepInfo.from_info(info)


def test_reset_info_checks_tools():
    assert ResetInfo.from_info({"task_id": 7, "tools": [{"a": 1}], "x": 2}) == ResetInfo(
        "7", ({"a": 1},), {"x": 2})
    with pytest.raises(EnvInfoError, match="tool schemas"):
        ResetInfo.from_info({"tools": "search"})


def test_tool_env_info_is_a_plain_gymnasium_dict_with_typed_fields():
    env = CalculatorEnv()
    _obs, info = env.reset(seed=0, options={"task": TASK})
    assert type(info) is dict and ResetInfo.from_info(info).task_id == "c1"
    assert [t["function"]["name"] for t in ResetInfo.from_info(info).tools] == ["calculator"]
    _, _, terminated, _, info = env.step(CALL)
    assert type(info) is dict and StepInfo.from_info(info).tool_calls == 1
    _, _reward, terminated, _, info = env.step(Message("assistant", "45"))
    step = StepInfo.from_info(info)
    assert terminated and step.stop_reason is StopReason.TERMINATED and step.final_reward is not None


class _Recorder:
    """A ToolRunner that answers one tool itself and runs the others through the env."""

    def __init__(self):
        self.tasks, self.calls = [], []

    def start_episode(self, task):
        self.tasks.append(task["id"])

    async def run(self, call, execute):
        self.calls.append(call.name)
        if "44" in call.arguments:
            return Message("tool", "forty-five", tool_call_id=call.id, name=call.name), False
        return await execute(call)


def test_an_injected_tool_runner_sees_resets_and_calls():
    runner = _Recorder()
    env = CalculatorEnv(tool_runner=runner)
    env.reset(seed=0, options={"task": TASK})
    obs, *_ = env.step(CALL)
    assert obs[0].content == "forty-five" and runner.tasks == ["c1"]
    two = ToolCall("calculator", '{"expression": "2 + 3"}', "call_1_0")
    obs, *_ = env.step(Message("assistant", "", tool_calls=(two,)))
    assert obs[0].content == "5" and runner.calls == ["calculator", "calculator"]
    assert "tool_runner" not in pickle_keys(env)  # a shared resource: not in snapshots


def pickle_keys(env):
    import pickle

    return set(pickle.loads(env.snapshot()))


def test_the_tool_cache_refuses_an_env_without_tools(tmp_path):
    from palaestra.envs.toy_text import FrozenLakeTextEnv
    from palaestra.errors import ConfigError
    from palaestra.rollout.tool_cache import ToolCache

    with pytest.raises(ConfigError, match="use_tool_runner"):
        ToolCache(tmp_path / "t.jsonl", "record").attach(FrozenLakeTextEnv(), "g")


def test_every_episode_kind_has_a_runner():
    assert set(RUNNERS) == set(EpisodeKind)
    from palaestra.envs.external_agent import ExternalAgentEnv
    from palaestra.rollout.gateway.external import ExternalEnv

    assert CalculatorEnv.episode_kind is EpisodeKind.STEPPED
    assert ExternalAgentEnv.episode_kind is EpisodeKind.EXTERNAL_AGENT
    assert ExternalEnv.episode_kind is EpisodeKind.POSTED


async def test_an_unknown_kind_is_a_failed_trajectory_not_a_crash():
    class Odd(CalculatorEnv):
        episode_kind = "teleport"  # type: ignore[assignment]

    request = EpisodeRequest(Odd(), TokenPlayer(None, None), SamplingParams())  # type: ignore[arg-type]
    traj = await play_episode(request)
    assert traj.stop_reason is StopReason.ERROR and "teleport" in traj.error
    assert "stepped" in traj.error


async def test_an_external_agent_env_needs_a_token_player():
    from palaestra.benchmarks.chat_episode import ChatPlayer
    from palaestra.envs.external_agent import ExternalAgentEnv

    env = ExternalAgentEnv(lambda url, task: None, reward_fn=lambda t, o, m: 0.0, dataset=[TASK])
    traj = await play_episode(EpisodeRequest(env, ChatPlayer(None), SamplingParams()))  # type: ignore[arg-type]
    assert traj.stop_reason is StopReason.ERROR and "TokenPlayer" in traj.error

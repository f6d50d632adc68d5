"""The env contract on small envs written here: tools, bad tool calls, rewards, snapshot/fork."""

import asyncio
import json

import pytest

from palaestra.envs import Env, MultiTurnEnv, StepResult, ToolEnv, tool
from palaestra.envs.tools import Tool
from palaestra.types import Message, StopReason, ToolCall


class EchoToolsEnv(ToolEnv):
    """Test env with tools that misbehave on purpose."""

    def initial_messages(self, task):
        return [Message("user", task["question"])]

    @tool(blocking=False)
    def add(self, a: int, b: int = 0) -> int:
        """Add two integers.

        Args:
            a: the first integer.
            b: the second integer.
        """
        return a + b

    @tool
    def fail(self) -> str:
        """Always raises."""
        raise RuntimeError("disk on fire")

    @tool(blocking=False)
    def big(self) -> str:
        """Returns a long text."""
        return "x" * 100

    @tool(blocking=False)
    def binary(self) -> bytes:
        """Returns bytes that are not UTF-8."""
        return b"ok \xff\xfe"

    @tool
    async def slow(self) -> str:
        """Never finishes in time."""
        await asyncio.sleep(10)
        return "late"

    def score(self, action):
        return 1.0 if "done" in action.content else 0.0


def _env(**kw):
    env = EchoToolsEnv(dataset=[{"question": "q"}], max_tool_output_chars=20, tool_timeout_s=0.2, **kw)
    env.reset(seed=0)
    return env


def _call(name, args, i=0):
    raw = args if isinstance(args, str) else json.dumps(args)
    return ToolCall(name=name, arguments=raw, id=f"c{i}")


def _act(*calls):
    return Message("assistant", "", tool_calls=tuple(calls))


def test_schema_from_signature_and_docstring():
    schema = {t["function"]["name"]: t["function"] for t in _env().tool_schemas()}
    add = schema["add"]
    assert add["description"] == "Add two integers."
    assert add["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first integer."}
    assert add["parameters"]["required"] == ["a"]
    assert schema["fail"]["parameters"]["properties"] == {}


def test_good_call_returns_tool_message():
    obs, reward, terminated, truncated, info = _env().step(_act(_call("add", {"a": 2, "b": 3})))
    assert obs == (Message("tool", "5", tool_call_id="c0", name="add"),)
    assert (reward, terminated, truncated, info["tool_errors"]) == (0.0, False, False, 0)


@pytest.mark.parametrize(
    "call, expected",
    [
        (_call("nope", {}), "unknown tool 'nope'; available tools: add, big, binary, fail, slow"),
        (_call("add", '{"a": 1,'), "not valid JSON"),
        (_call("add", "[1, 2]"), "must be a JSON object"),
        (_call("add", {"a": "seven"}), "invalid arguments for 'add': a: Input should be a valid integer"),
        (_call("add", {"a": 1, "c": 2}), "c: Extra inputs are not permitted"),
        (_call("add", {}), "a: Field required"),
        (_call("fail", {}), "'fail' raised RuntimeError: disk on fire"),
        (_call("binary", {}), "not valid UTF-8"),
        (_call("slow", {}), "did not finish within 0.2 s"),
        (ToolCall(name="", arguments="<tool_call>{", parse_error="unclosed tag"), "could not parse the tool call: unclosed tag"),
    ],
)
def test_bad_calls_become_error_observations(call, expected):
    env = _env()
    obs, reward, terminated, truncated, info = env.step(_act(call))
    assert len(obs) == 1 and obs[0].role == "tool"
    assert obs[0].content.startswith("Error: ") and expected in obs[0].content
    assert not terminated and not truncated and info["tool_errors"] == 1
    # the episode goes on: a good call afterwards works
    obs, *_ = env.step(_act(_call("add", {"a": 1})))
    assert obs[0].content == "1"


def test_long_output_is_truncated_with_marker():
    obs, *_ = _env().step(_act(_call("big", {})))
    assert obs[0].content == "x" * 20 + "\n...[truncated 80 characters]"


def test_several_calls_run_and_keep_their_ids():
    obs, *_ = _env().step(_act(_call("add", {"a": 1}, 0), _call("nope", {}, 1), _call("add", {"a": 2}, 2)))
    assert [m.tool_call_id for m in obs] == ["c0", "c1", "c2"]
    assert [m.content for m in obs][::2] == ["1", "2"]


def test_consecutive_errors_end_with_parse_error():
    env = _env(max_consecutive_errors=2)
    env.step(_act(_call("nope", {})))
    _, _, terminated, _, info = env.step(_act(_call("add", "{bad")))
    assert terminated and info["stop_reason"] == StopReason.PARSE_ERROR.value


def test_final_answer_and_max_turns():
    env = _env()
    _, reward, terminated, _, info = env.step("done")
    assert (reward, terminated, info["stop_reason"]) == (1.0, True, "terminated")
    env = EchoToolsEnv(dataset=[{"question": "q"}], max_turns=1)
    env.reset(seed=0)
    _, _, terminated, truncated, info = env.step(_act(_call("add", {"a": 1})))
    assert (terminated, truncated, info["stop_reason"]) == (False, True, "truncated")


def test_step_before_reset_and_after_end_raise():
    import gymnasium

    env = EchoToolsEnv(dataset=[{"question": "q"}])
    with pytest.raises(gymnasium.error.ResetNeeded):
        env.step("x")
    env.reset(seed=0)
    env.step("done")
    with pytest.raises(gymnasium.error.ResetNeeded):
        env.step("x")


async def test_async_twins_match_sync():
    env = _env()
    obs, *_ = await env.astep(_act(_call("add", {"a": 4, "b": 4})))
    assert obs[0].content == "8"
    obs2, info = await env.areset(seed=0)
    assert obs2 == (Message("user", "q"),) and info["task_id"]


def test_extra_tool_functions_and_name_clash():
    def mul(x: float, y: float) -> float:
        """Multiply."""
        return x * y

    env = EchoToolsEnv(dataset=[{"question": "q"}], tools=[mul])
    env.reset(seed=0)
    obs, *_ = env.step(_act(_call("mul", {"x": 2, "y": 1.5})))
    assert obs[0].content == "3.0"

    def add(a: int) -> int:
        """Clash."""
        return a

    from palaestra.errors import ConfigError

    with pytest.raises(ConfigError, match="two tools are named 'add'"):
        EchoToolsEnv(dataset=[{"question": "q"}], tools=[add])
    with pytest.raises(ConfigError, match="needs a type hint"):
        Tool.from_function(lambda x: x)


class Counter(MultiTurnEnv):
    """Counts to a target; per-turn reward 0.1, final reward 1 when reached."""

    step_in_thread = False

    def initial_messages(self, task):
        self.count = 0
        return [Message("user", f"count to {task['target']}")]

    def respond(self, action):
        self.count += 1
        return StepResult([Message("user", str(self.count))], reward=0.1, terminated=self.count >= self.task["target"])

    def final_reward(self):
        return 1.0 if self.count >= self.task["target"] else 0.0


def test_multiturn_per_turn_and_final_rewards():
    env = Counter(dataset=[{"target": 2}], max_turns=5)
    env.reset(seed=0)
    assert env.step("a")[1] == pytest.approx(0.1)
    obs, reward, terminated, _, info = env.step("b")
    assert terminated and reward == pytest.approx(1.1) and info["final_reward"] == 1.0


def test_fork_branches_continue_independently():
    env = Counter(dataset=[{"target": 3}], max_turns=5)
    env.reset(seed=0)
    env.step("a")
    child = env.fork()
    env.step("b")
    env.step("c")
    assert env.done and env.count == 3
    assert not child.done and child.count == 1 and child.turn == 1
    obs, *_ = child.step("b'")
    assert obs[0].content == "2" and child.history[-2].content == "b'"
    state = child.snapshot()
    child.step("c'")
    child.restore(state)
    assert child.count == 2 and not child.done


def test_dataset_required_message():
    from palaestra.errors import ConfigError

    with pytest.raises(ConfigError, match="has no dataset"):
        Counter().reset(seed=0)


def test_env_is_gymnasium_env():
    import gymnasium

    assert issubclass(Env, gymnasium.Env)


# ----- text actions: tool calls parsed with the env's tool-call format ------------------------

CALC_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'


def test_text_tool_call_runs_the_tool_on_calculator():
    from palaestra import envs

    env = envs.make("palaestra/Calculator-v0")
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(CALC_CALL)
    assert obs == (Message("tool", "4", tool_call_id="call_0_0", name="calculator"),)
    assert (reward, terminated, truncated, info["tool_calls"]) == (0.0, False, False, 1)
    gold = env.task["answer"]
    obs, reward, terminated, _, info = env.step(f"The result is <answer>{gold}</answer>")
    assert (obs, reward, terminated, info["correct"]) == ((), 1.0, True, True)


def test_text_without_a_tool_call_is_an_answer_and_keeps_its_content():
    env = _env()
    _, reward, terminated, _, _ = env.step("I am done")
    assert (reward, terminated) == (1.0, True)
    assert env.history[-1] == Message("assistant", "I am done")


def test_text_with_several_calls_and_text_before_them():
    env = _env()
    text = ('Let me add. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 5}}</tool_call>')
    obs, *_ = env.step(text)
    assert [(m.content, m.tool_call_id) for m in obs] == [("1", "call_0_0"), ("7", "call_0_1")]
    assert env.history[-3].content == "Let me add."  # the action as parsed
    obs, *_ = env.step('<tool_call>{"name": "add", "arguments": {"a": 3}}</tool_call>')
    assert obs[0].tool_call_id == "call_1_0"  # ids stay unique within the episode


@pytest.mark.parametrize(
    "text, expected",
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', "invalid JSON in <tool_call>"),
        ('<tool_call>{"name": "add", "arguments": {"a": 1}}', "unclosed <tool_call> tag"),
        ('<tool_call>{"name": "add"} extra</tool_call>', "unexpected text after the JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'the call has no "name" string'),
        ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "unknown tool 'nope'"),
        ('<tool_call>{"name": "add", "arguments": {"a": "x"}}</tool_call>', "a: Input should be a valid integer"),
    ],
)
def test_malformed_text_tool_calls_become_error_observations(text, expected):
    env = _env()
    obs, _, terminated, _, info = env.step(text)
    assert len(obs) == 1 and obs[0].content.startswith("Error: ") and expected in obs[0].content
    assert not terminated and info["tool_errors"] == 1


def test_a_tool_call_inside_a_think_block_is_not_a_call():
    env = _env()
    _, reward, terminated, _, _ = env.step(
        '<think>maybe <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call></think>done')
    assert (reward, terminated) == (1.0, True)
    assert env.history[-1].reasoning_content.startswith("maybe")


async def test_async_step_parses_text_too():
    env = _env()
    obs, *_ = await env.astep('<tool_call>{"name": "add", "arguments": {"a": 4, "b": 4}}</tool_call>')
    assert obs[0].content == "8"


class LlamaToolsEnv(EchoToolsEnv):
    tool_call_format = "llama3"


def test_tool_call_format_per_env_class_and_per_instance():
    from palaestra.errors import ConfigError

    llama_call = '{"name": "add", "parameters": {"a": 2, "b": 2}}'
    env = LlamaToolsEnv(dataset=[{"question": "q"}])
    env.reset(seed=0)
    obs, *_ = env.step(llama_call)
    assert obs[0].content == "4"
    # the constructor argument beats the class default: Hermes text is no call for Llama
    env = LlamaToolsEnv(dataset=[{"question": "q"}], tool_call_format="qwen")
    env.reset(seed=0)
    obs, *_ = env.step('<tool_call>{"name": "add", "arguments": {"a": 3}}</tool_call>')
    assert obs[0].content == "3"
    # "none": text is only content, never a call
    env = EchoToolsEnv(dataset=[{"question": "q"}], tool_call_format="none")
    env.reset(seed=0)
    _, _, terminated, _, _ = env.step(CALC_CALL)
    assert terminated and env.history[-1].content == CALC_CALL
    with pytest.raises(ConfigError, match="unknown tool-call format 'xml'"):
        EchoToolsEnv(dataset=[{"question": "q"}], tool_call_format="xml")


def test_text_actions_parse_like_the_agents_do():
    """One parser: the env's text path and the agent's sampled-text path give the same message."""
    from palaestra.agents import get_renderer
    from palaestra.tool_parsers import number_calls

    text = '<think>add</think>Sure. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    parsed = _env().message_from_text(text)
    assert parsed == number_calls(get_renderer("qwen").parse(text), 0)
    assert (parsed.content, parsed.reasoning_content, parsed.tool_calls[0].name) == (
        "Sure.", "add", "add")


def test_palaestra_exposes_subpackages_lazily():
    import palaestra

    assert palaestra.envs.make is not None and palaestra.agents.AgentSpec is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        palaestra.nope  # noqa: B018


def test_envs_parse_text_without_importing_agents():
    """The dependency direction (envs below agents) holds on the text-action path."""
    import subprocess
    import sys

    code = (
        "import sys, palaestra.envs as envs\n"
        "env = envs.make('palaestra/Calculator-v0'); env.reset(seed=0)\n"
        f"assert env.step({CALC_CALL!r})[0][0].content == '4'\n"
        "print(sorted(m for m in sys.modules if m.startswith('palaestra.agents')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

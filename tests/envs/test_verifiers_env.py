"""`VerifiersEnv` against a verifiers (v1) taskset built here from verifiers' own classes
(`TaskData`, `Task` with `@vf.reward` functions, `Taskset`): its prompts, its weighted rewards,
seeding and explicit task rows, and the palaestra checks and rollout path on top."""

from __future__ import annotations

import pytest

vf = pytest.importorskip("verifiers.v1")

from palaestra.envs.ecosystem.verifiers_env import VerifiersEnv

ROWS = [("What is 2 + 2?", "4"), ("What is 3 * 5?", "15"), ("Capital of France?", "Paris")]


class QAData(vf.TaskData):
    answer: str


class QATask(vf.Task[QAData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=0.8)
    async def correct(self, trace) -> float:
        return float(self.data.answer.lower() in (trace.messages[-1].content or "").lower())

    @vf.reward(weight=0.2)
    async def brief(self, trace) -> float:
        return float(len(trace.messages[-1].content or "") <= 20)


class QATaskset(vf.Taskset[QATask, vf.TasksetConfig]):
    def load(self):
        for question, answer in ROWS:
            yield QATask(QAData(prompt=question, answer=answer, system_prompt="Answer briefly."),
                         self.config.task)


@pytest.fixture
def env():
    env = VerifiersEnv(taskset=QATaskset(vf.TasksetConfig()))
    yield env
    env.close()


def test_prompts_and_weighted_rubric(env):
    obs, _ = env.reset(options={"task": env.dataset[1]})
    assert [(m.role, m.content) for m in obs] == [("system", "Answer briefly."),
                                                  ("user", "What is 3 * 5?")]
    _, reward, terminated, _, step_info = env.step("15")
    assert terminated and reward == pytest.approx(1.0)
    assert step_info["rewards"] == {"correct": 1.0, "brief": 1.0}
    env.reset(options={"task": env.dataset[1]})
    _, reward, *_ , step_info = env.step("I am not sure, but it might be 14 or so.")
    assert reward == pytest.approx(0.0) and step_info["rewards"] == {"correct": 0.0, "brief": 0.0}
    env.reset(options={"task": env.dataset[2]})
    _, reward, *_ = env.step("It is Paris, the capital city of France.")
    assert reward == pytest.approx(0.8)  # right but not brief


def test_seeds_rows_and_checks(env):
    a, _ = env.reset(seed=3)
    b, _ = VerifiersEnv(taskset=QATaskset(vf.TasksetConfig())).reset(seed=3)
    assert a == b
    # an explicit row without the index: a task of the taskset's type built from its data
    obs, _ = env.reset(options={"task": {"prompt": "What is 6 * 7?", "answer": "42"}})
    assert obs[-1].content == "What is 6 * 7?"
    assert env.step("42")[1] == pytest.approx(1.0)
    from gymnasium.utils.env_checker import check_env

    check_env(env, skip_render_check=True)
    env.reset(seed=0)
    child = env.fork()
    env.step("branch one")
    assert child.turn == 0 and not child.done


async def test_through_the_rollout_path(tmp_path):
    from palaestra.agents import make_agent
    from palaestra.rollout.play import run_episode
    from palaestra.engine import SamplingParams
    from palaestra.engines.clients.scripted import ScriptedEngine
    from palaestra.tiny_model import build_model
    from palaestra.types import StopReason

    model = build_model(tmp_path / "model", "micro")
    agent = make_agent(str(model), "qwen", max_context=512)
    tok = agent.tokenizer
    engine = ScriptedEngine([*tok.encode("Paris", add_special_tokens=False),
                             tok.convert_tokens_to_ids("<|im_end|>")])
    env = VerifiersEnv(taskset=QATaskset(vf.TasksetConfig()))
    traj = await run_episode(env, agent, engine, SamplingParams(max_new_tokens=16),
                             task=env.dataset[2])
    assert traj.error is None and traj.stop_reason is StopReason.TERMINATED
    assert traj.reward == pytest.approx(1.0) and traj.samples[0].num_sampled > 0


def test_bad_arguments_say_how_to_fix():
    from palaestra.errors import ConfigError

    with pytest.raises(ConfigError, match="taskset"):
        VerifiersEnv()
    with pytest.raises(ConfigError, match="verifiers.v1.Taskset"):
        VerifiersEnv(taskset=[1, 2])


TASKSET_MODULE = '''
"""An installed verifiers taskset, as a package exports one (its Taskset subclass in __all__)."""
import verifiers.v1 as vf


class EchoData(vf.TaskData):
    word: str


class EchoTask(vf.Task[EchoData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def echoed(self, trace) -> float:
        return float(trace.messages[-1].content.strip() == self.data.word)


class EchoTaskset(vf.Taskset[EchoTask, vf.TasksetConfig]):
    def load(self):
        for word in ("alpha", "beta", "gamma"):
            yield EchoTask(EchoData(prompt=f"Repeat exactly: {word}", word=word), self.config.task)


__all__ = ["EchoTaskset"]
'''


def test_an_installed_taskset_by_id(tmp_path, monkeypatch):
    from palaestra.envs import make

    (tmp_path / "echo_words.py").write_text(TASKSET_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make("palaestra.envs.ecosystem:ecosystem/Verifiers-v0", taskset_id="echo-words")
    assert env.source == "verifiers:echo-words" and len(env.dataset) == 3
    obs, _ = env.reset(options={"task": env.dataset[1]})
    assert obs[-1].content == "Repeat exactly: beta"
    assert env.step("beta")[1] == 1.0
    env.reset(options={"task": env.dataset[1]})
    assert env.step("alpha")[1] == 0.0
    env.close()


def test_make_verifiers_spelling(tmp_path, monkeypatch):
    """``make("verifiers:<id>")``: the installed taskset by its id, as `palaestra train` and
    `palaestra eval` name it in a config; the envs CLI checks it the same way."""
    from palaestra.envs import make
    from palaestra.envs.checks import check_env_id
    from palaestra.errors import ConfigError, PalaestraError

    (tmp_path / "echo_words.py").write_text(TASKSET_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make("verifiers:echo-words")
    assert type(env) is VerifiersEnv and env.source == "verifiers:echo-words"
    obs, _ = env.reset(options={"task": env.dataset[2]})
    assert obs[-1].content == "Repeat exactly: gamma"
    assert env.step("gamma")[1] == 1.0
    env.close()
    report = check_env_id("verifiers:echo-words")
    assert report.ok, report.failed
    with pytest.raises(ConfigError, match="verifiers environment id"):
        make("verifiers:not an id!")
    with pytest.raises(PalaestraError):  # not installed: verifiers' own loader says which
        make("verifiers:no-such-taskset-here")


TOOLS_MODULE = '''
"""A verifiers taskset with a Toolset: the model must call `multiply` and answer with its result."""
import verifiers.v1 as vf


class Calc(vf.Toolset[vf.ToolsetConfig, vf.State]):
    @vf.tool
    async def multiply(self, a: int, b: int) -> str:
        """Multiply two integers."""
        return str(a * b + 1000)  # not the product: only a model that used the tool knows it

    @vf.tool
    async def divide(self, a: int, b: int) -> str:
        """Divide two integers."""
        return str(a / b)


class CalcData(vf.TaskData):
    a: int
    b: int


class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Calc(vf.ToolsetConfig())]

    @vf.reward
    async def used_tool(self, trace) -> float:
        return float(trace.messages[-1].content.strip() == str(self.data.a * self.data.b + 1000))


class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self):
        for a, b in ((6, 7), (3, 4)):
            yield CalcTask(CalcData(prompt=f"Use the tool: {a} times {b}?", a=a, b=b),
                           self.config.task)


__all__ = ["CalcTaskset"]
'''


def test_toolset_tasks_are_multi_turn(tmp_path, monkeypatch):
    """A task with a verifiers `Toolset`: its tool schema offered to the model, calls served by
    the toolset's own MCP server (a real subprocess on loopback), the rubric on the last turn."""
    from palaestra.envs import make
    from palaestra.types import Message, ToolCall

    (tmp_path / "calc_tools.py").write_text(TOOLS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make("verifiers:calc-tools")
    try:
        names = [s["function"]["name"] for s in env.tool_schemas()]
        assert sorted(names) == ["divide", "multiply"]
        schema = next(s for s in env.tool_schemas() if s["function"]["name"] == "multiply")
        assert set(schema["function"]["parameters"]["properties"]) == {"a", "b"}
        assert schema["function"]["description"] == "Multiply two integers."
        obs, _ = env.reset(options={"task": env.dataset[0]})
        assert obs[-1].content == "Use the tool: 6 times 7?"
        call = Message(role="assistant", content="", tool_calls=(
            ToolCall(id="c1", name="multiply", arguments='{"a": 6, "b": 7}'),))
        obs, reward, terminated, _, _ = env.step(call)
        assert not terminated and obs[-1].role == "tool" and obs[-1].content.strip() == "1042"
        obs, reward, terminated, _, _ = env.step("1042")
        assert terminated and reward == 1.0
        env.reset(options={"task": env.dataset[1]})
        _, reward, terminated, _, _ = env.step("12")  # answered without the tool
        assert terminated and reward == 0.0
        env.reset(options={"task": env.dataset[1]})
        for name, arguments, expected in (("power", "{}", "unknown tool"),
                                          ("divide", '{"a": 1, "b": 0}', "division by zero")):
            bad = Message(role="assistant", content="", tool_calls=(
                ToolCall(id="c2", name=name, arguments=arguments),))
            obs, _, terminated, _, info = env.step(bad)  # an error observation; the episode goes on
            assert expected in obs[-1].content and not terminated and info["tool_errors"] == 1
        assert env.step("12")[1] == 0.0
    finally:
        env.close()


BROKEN_TOOLS = TOOLS_MODULE.replace("class CalcData", """
class Broken(vf.Toolset[vf.ToolsetConfig, vf.State]):
    async def setup(self):
        raise RuntimeError("the toolset cannot start here")

    @vf.tool
    async def noop(self) -> str:
        return ""


class CalcData""").replace("return [Calc(vf.ToolsetConfig())]", "return [Broken(vf.ToolsetConfig())]")


def test_a_toolset_that_cannot_start_says_why(tmp_path, monkeypatch):
    from palaestra.envs import make
    from palaestra.errors import ToolError

    (tmp_path / "broken_tools.py").write_text(BROKEN_TOOLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make("verifiers:broken-tools", startup_timeout_s=120)  # bounds a loaded machine
    with pytest.raises(ToolError, match="cannot start here"):
        env.tool_schemas()
    env.close()


@pytest.mark.slow
def test_short_grpo_run_on_a_verifiers_toolset_taskset(tmp_path, monkeypatch):
    """Two GRPO steps of the real training loop on ``env.id = "verifiers:calc-tools"`` (tasks
    drawn from the verifiers taskset, its toolset's server per episode, its rubric as reward)."""
    import json

    import torch

    from palaestra.config import load_config
    from palaestra.tiny_model import build_model
    from palaestra.run.config import TrainConfig
    from palaestra.run.train import train

    torch.set_num_threads(1)
    model = build_model(tmp_path / "model", "micro")
    (tmp_path / "calc_tools.py").write_text(TOOLS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "run.toml"
    config.write_text(f'''
out = "{tmp_path / "run"}"
seed = 0
[model]
path = "{model}"
[env]
id = "verifiers:calc-tools"
[agent]
max_context = 1024
[rollout]
cluster = "local"
num_workers = 1
max_new_tokens = 32
temperature = 1.0
batch_size = 2
group_size = 2
[engine]
device = "cpu"
[eval]
num_tasks = 1
[trainer]
steps = 2
[trainer.torch]
device = "cpu"
lr = 0.05
pack_sequences = false
[trainer.loss]
preset = "grpo"
[checkpoint]
interval = 2
keep_last = 1
[logging]
progress = false
tensorboard = false
''')
    train(load_config(TrainConfig, config))
    metrics = [json.loads(line) for line in
               (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rl = [r for r in metrics if r.get("phase") == "rl"]
    assert [r["step"] for r in rl] == [0, 1]
    assert all(r["episodes/failed"] == 0 and r["train/num_loss_tokens"] > 0 for r in rl)

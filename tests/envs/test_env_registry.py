"""Registry-wide checks: every registered palaestra env passes check_env and our own checks."""

import pytest

import palaestra.envs as envs
from palaestra.envs.checks import check_env_id
from palaestra.errors import EnvNotFoundError


@pytest.mark.parametrize("env_id", envs.palaestra_env_ids())
def test_every_registered_env_passes_all_checks(env_id):
    report = check_env_id(env_id)
    assert report.ok, report.failed


def test_unknown_id_suggests_close_matches():
    with pytest.raises(EnvNotFoundError, match="Did you mean palaestra/Calculator-v0"):
        envs.make("palaestra/Calculater-v0")


def test_module_prefix_imports_third_party_package(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(
        "import palaestra.envs as envs\n"
        "from palaestra.envs.calculator import CalculatorEnv\n"
        "class Small(CalculatorEnv):\n    pass\n"
        "envs.register('mine/Small-v0', entry_point='my_envs:Small', max_value=20)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env = envs.make("my_envs:mine/Small-v0")
    env.reset(seed=0)
    assert type(env).__name__ == "Small" and env.max_value == 20
    with pytest.raises(EnvNotFoundError, match="cannot import"):
        envs.make("no_such_module:mine/X-v0")


def test_describe_lists_tools():
    info = envs.describe("palaestra/Calculator-v0")
    assert info.tools == ("calculator",) and info.error is None


def test_calculator_gold_answer_gets_reward_one():
    from palaestra.types import Message, ToolCall
    import json

    env = envs.make("palaestra/Calculator-v0")
    for seed in range(5):
        env.reset(seed=seed)
        call = ToolCall("calculator", json.dumps({"expression": env.task["expression"]}), id="c")
        obs, *_ = env.step(Message("assistant", "", tool_calls=(call,)))
        assert obs[0].content == env.task["answer"]
        _, reward, terminated, _, _ = env.step(f"<answer>{obs[0].content}</answer>")
        assert reward == 1.0 and terminated
    env.reset(seed=0)
    assert env.step("<answer>-1</answer>")[1] == 0.0

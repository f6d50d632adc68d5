"""GSM8K-v0 and MATH-v0: shipped data, gold answers in every accepted form, wrong answers, rows."""

import pytest

from palaestra.envs import make
from palaestra.envs.math import GSM8KEnv, MATHEnv, gsm8k_gold
from palaestra.errors import ConfigError


def test_gsm8k_shipped_splits_and_gold_answers():
    env = make("palaestra/GSM8K-v0")
    assert len(env.dataset) == 1319
    assert len(GSM8KEnv(dataset="train").dataset) == 7473
    obs, info = env.reset(seed=0)
    assert [m.role for m in obs] == ["system", "user"] and "\\boxed{}" in obs[0].content
    assert info["tools"] == [] and env.max_turns == 1
    for seed in range(10):
        env.reset(seed=seed)
        gold = gsm8k_gold(env.task)
        _, reward, terminated, truncated, info = env.step(f"Reasoning...\nSo the answer is \\boxed{{{gold}}}.")
        assert (reward, terminated, truncated) == (1.0, True, False) and info["correct"]


@pytest.mark.parametrize(
    "reply,reward",
    [
        ("The total is \\boxed{1,000}.", 1.0),
        ("#### 1000", 1.0),
        ("\\boxed{\\$1000.00}", 1.0),
        ("\\boxed{1000 \\text{ dollars}}", 1.0),
        ("<answer>1000</answer>", 1.0),
        ("\\boxed{999}", 0.0),
        ("The answer is 1000.", 0.0),  # no final-answer marker: not graded as an answer
        ("\\boxed{1000} wait, no: \\boxed{10}", 0.0),  # the last box counts
    ],
)
def test_gsm8k_answer_forms(reply, reward):
    env = GSM8KEnv()
    env.reset(options={"task": {"question": "How much?", "answer": "500 * 2 = 1000\n#### 1000"}})
    assert env.step(reply)[1] == reward


def test_math500_gold_answers_and_equivalent_forms():
    env = make("palaestra/MATH-v0")
    assert len(env.dataset) == 500
    env.reset(seed=0)
    for seed in range(10):
        env.reset(seed=seed)
        _, reward, *_ = env.step(f"Therefore the answer is $\\boxed{{{env.task['answer']}}}$.")
        assert reward == 1.0, env.task["answer"]
    task = {"problem": "Convert (0,3) to polar.", "answer": r"\left( 3, \frac{\pi}{2} \right)"}
    env.reset(options={"task": task})
    _, reward, _, _, info = env.step(r"so \boxed{(3, \pi/2)}")
    assert reward == 1.0 and info["answer"] == r"(3, \pi/2)"
    env.reset(options={"task": task})
    assert env.step(r"so \boxed{(3, \pi)}")[1] == 0.0


async def test_async_grading_runs_off_the_event_loop():
    env = MATHEnv()
    await env.areset(options={"task": {"problem": "Simplify sqrt(18).", "answer": r"3\sqrt{2}"}})
    _, reward, terminated, _, info = await env.astep(r"\boxed{\sqrt{18}}")
    assert reward == 1.0 and terminated and info["gold"] == r"3\sqrt{2}"


def test_bad_rows_fail_at_reset_with_a_reason(tmp_path):
    with pytest.raises(ConfigError, match="'question'"):
        GSM8KEnv().reset(options={"task": {"problem": "x", "answer": "#### 1"}})
    with pytest.raises(ConfigError, match="nothing after"):
        GSM8KEnv().reset(options={"task": {"question": "x", "answer": "####   "}})
    with pytest.raises(ConfigError, match="'answer'"):
        MATHEnv().reset(options={"task": {"problem": "x", "solution": "no box"}})
    path = tmp_path / "mine.jsonl"
    path.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    env = GSM8KEnv(dataset=path)
    env.reset(seed=0)
    assert env.step("\\boxed{2}")[1] == 1.0
    with pytest.raises(ConfigError, match="shipped datasets \\(test, train\\)"):
        GSM8KEnv(dataset="validation").reset(seed=0)


def test_snapshot_leaves_the_dataset_out():
    env = GSM8KEnv(dataset="train")
    env.reset(seed=1)
    assert len(env.snapshot()) < 20_000
    clone = env.fork()
    assert clone.task == env.task and clone.dataset is env.dataset


async def test_python_tool_runs_code_in_the_sandbox():
    import json

    sandbox_module = pytest.importorskip("palaestra.sandbox")
    from palaestra.types import Message, ToolCall

    async with sandbox_module.LocalSandbox() as sb:
        env = make("palaestra/GSM8K-v0", python_tool=True, sandbox=sb, code_timeout_s=2.0)
        _, info = await env.areset(options={"task": {"question": "17 * 23?", "answer": "#### 391"}})
        assert [t["function"]["name"] for t in info["tools"]] == ["python"]
        assert "python tool" in env.system_prompt and env.max_turns == 6
        calls = (
            ToolCall("python", json.dumps({"code": "print(17 * 23)"}), id="a"),
            ToolCall("python", json.dumps({"code": "1 / 0"}), id="b"),
            ToolCall("python", json.dumps({"code": "while True: pass"}), id="c"),
        )
        obs, reward, terminated, _, info = await env.astep(Message("assistant", "", tool_calls=calls))
        out = {m.tool_call_id: m.content for m in obs}
        assert out["a"] == "391\n"
        assert "ZeroDivisionError" in out["b"] and "[exit code 1]" in out["b"]
        assert "[timed out after 2 s]" in out["c"]
        assert not terminated and reward == 0.0 and info["tool_errors"] == 0
        _, reward, terminated, *_ = await env.astep("So \\boxed{391}.")
        assert reward == 1.0 and terminated


def test_without_tools_a_message_with_parsed_tool_calls_is_still_the_answer():
    from palaestra.types import Message, ToolCall

    env = GSM8KEnv()  # e.g. an agent whose parser turned a code block into a python call
    env.reset(options={"task": {"question": "1+1?", "answer": "#### 2"}})
    call = ToolCall("python", '{"code": "print(1+1)"}', id="x")
    _, reward, terminated, *_ = env.step(Message("assistant", "```python\nprint(1+1)\n```\n\\boxed{2}", tool_calls=(call,)))
    assert reward == 1.0 and terminated

"""SmolLM2-Instruct's tool format: the parser (arrays, a bare object, ``[]``, broken calls), the
calculator env driven with it (a malformed call is an error observation), and the ``smollm2``
family's template (tools in the system turn, structured calls rendered, sampled text kept)."""

from __future__ import annotations

import json

import pytest

from palaestra import envs
from palaestra.agents.renderers import get_renderer
from palaestra.tool_parsers import get_parser
from palaestra.types import Message, ToolCall

CALL = '<tool_call>[{"name": "calculator", "arguments": {"expression": "12 * 34"}}]</tool_call>'


def test_an_array_of_calls() -> None:
    text = ('<tool_call>[{"name": "calculator", "arguments": {"expression": "1 + 2"}}, '
            '{"name": "calculator", "arguments": {"expression": "3 * 4"}}]</tool_call>')
    message = get_parser("smollm2").parse(text)
    assert [(c.name, json.loads(c.arguments), c.parse_error) for c in message.tool_calls] == [
        ("calculator", {"expression": "1 + 2"}, None), ("calculator", {"expression": "3 * 4"}, None)]
    assert [c.id for c in message.tool_calls] == ["call_0", "call_1"]
    assert message.content == text  # the text the model wrote is the record


def test_a_bare_object_and_an_empty_list() -> None:
    bare = get_parser("smollm").parse('<tool_call>{"name": "calculator", "arguments": '
                                      '{"expression": "5"}}</tool_call>')
    assert bare.tool_calls[0].name == "calculator" and bare.tool_calls[0].parse_error is None
    empty = get_parser("smollm2").parse("<tool_call>[]</tool_call><answer>7</answer>")
    assert empty.tool_calls == () and "<answer>7</answer>" in empty.content
    plain = get_parser("smollm2").parse("  The answer is <answer>7</answer>.")
    assert plain.tool_calls == () and plain.content == "The answer is <answer>7</answer>."


@pytest.mark.parametrize("text, error", [
    ('<tool_call>[{"name": "calculator", "arguments": {"expression": "1+2"}</tool_call>',
     "invalid JSON"),
    ('<tool_call>[{"name": "calculator", "arguments": {"expression": "1+2"}}]', "unclosed"),
    ('<tool_call>[{"arguments": {"expression": "1+2"}}]</tool_call>', '"name"'),
    ("<tool_call>[42]</tool_call>", '"name"'),
])
def test_broken_calls_carry_a_parse_error(text: str, error: str) -> None:
    (call,) = get_parser("smollm2").parse(text).tool_calls
    assert call.parse_error is not None and error in call.parse_error


def test_the_env_answers_a_malformed_call_with_an_error_and_goes_on() -> None:
    env = envs.make("palaestra/Calculator-v0", tool_call_format="smollm2", min_value=10,
                    max_value=99, num_operations=1)
    env.reset(seed=0)
    obs, reward, terminated, truncated, _ = env.step('<tool_call>[{"name": "calculator"'
                                                      '</tool_call>')
    assert reward == 0.0 and not terminated and not truncated
    assert obs[-1].role == "tool" and "invalid JSON" in obs[-1].content
    expression = env.task["question"].removeprefix("What is ").removesuffix("?")
    obs, reward, terminated, *_ = env.step(CALL.replace("12 * 34", expression))
    assert obs[-1].content == env.task["answer"] and not terminated
    obs, reward, terminated, *_ = env.step(f"<answer>{env.task['answer']}</answer>")
    assert reward == 1.0 and terminated
    env.close()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from palaestra.tiny_model import build_tokenizer

    return build_tokenizer(vocab_size=512)


def test_the_template_puts_the_tools_in_the_system_turn(tokenizer) -> None:
    env = envs.make("palaestra/Calculator-v0")
    renderer = get_renderer("smollm2")
    messages = [Message("system", "Answer as <answer>N</answer>."), Message("user", "What is 2+2?")]
    text = renderer.render(tokenizer, messages, tools=env.tool_schemas(), add_generation_prompt=True)
    head, _, tail = text.partition("<tools>")
    assert head.startswith("<|im_start|>system\nYou are an expert in composing functions.")
    tools = json.loads(tail.split("</tools>")[0])
    assert tools[0]["name"] == "calculator" and "expression" in tools[0]["parameters"]["properties"]
    assert "<tool_call>[\n" in text and "Answer as <answer>N</answer>.<|im_end|>" in text
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    no_tools = renderer.render(tokenizer, messages[1:], add_generation_prompt=False)
    assert no_tools.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_calls_render_in_the_models_form_and_sampled_text_as_written(tokenizer) -> None:
    renderer = get_renderer("smollm2")
    structured = Message("assistant", "", tool_calls=(
        ToolCall("calculator", '{"expression": "12 * 34"}', id="call_0"),))
    sampled = renderer.parse('<tool_call>[ {"name":"calculator","arguments":{"expression":"1+1"}} ]'
                             "</tool_call>")
    text = renderer.render(tokenizer, [Message("user", "q"), structured,
                                       Message("tool", "408", tool_call_id="call_0"), sampled],
                           add_generation_prompt=False)
    assert f"<|im_start|>assistant\n{CALL}<|im_end|>\n" in text
    assert "<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n" in text
    assert f"<|im_start|>assistant\n{sampled.content}<|im_end|>\n" in text

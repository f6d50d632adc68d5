"""Each output parser on crafted outputs, broken ones included (no tokenizer needed)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from palaestra.agents import (
    HermesParser,
    Llama3Parser,
    PythonBlockParser,
    SearchR1Parser,
    extract_answer,
    split_reasoning,
)
from palaestra.tool_parsers.common import scan_object

CALC = '{"name": "calculator", "arguments": {"expression": "2 + 3"}}'


# ----------------------------------------------------------------------------- shared helpers


def test_split_reasoning_forms():
    assert split_reasoning("<think>\nplan\n</think>\n\nanswer") == ("plan", "answer")
    assert split_reasoning("plan only closed</think>answer") == ("plan only closed", "answer")
    assert split_reasoning("<think>cut off while thinking") == ("cut off while thinking", "")
    assert split_reasoning("<think>\n\n</think>\n\nx") == (None, "x")
    assert split_reasoning("no thinking") == (None, "no thinking")


def test_scan_object_keeps_raw_values():
    fields, end = scan_object('  {"a" :{"x":1,  "y":[1, 2]} , "b": "s"} tail')
    assert fields["a"] == ({"x": 1, "y": [1, 2]}, '{"x":1,  "y":[1, 2]}')
    assert fields["b"] == ("s", '"s"')
    assert '  {"a" :{"x":1,  "y":[1, 2]} , "b": "s"} tail'[end:] == " tail"
    for bad in ('{"a": 1', '{"a" 1}', "{a: 1}", "[1]", '{"a": 1,}'):
        with pytest.raises(ValueError):
            scan_object(bad)


# ----------------------------------------------------------------------------- Hermes / Qwen


def test_hermes_plain_answer_and_thinking():
    msg = HermesParser().parse("<think>\nadd them\n</think>\n\nThe answer is 5.")
    assert (msg.role, msg.content, msg.reasoning_content, msg.tool_calls) == (
        "assistant",
        "The answer is 5.",
        "add them",
        (),
    )


def test_hermes_single_call_keeps_raw_arguments():
    raw_args = '{"expression":   "2 +  3" , "precise": true}'
    call = f'{{"name": "calculator", "arguments": {raw_args}}}'
    text = f"Let me compute.\n<tool_call>\n{call}\n</tool_call>"
    msg = HermesParser().parse(text)
    assert msg.content == "Let me compute."
    (call,) = msg.tool_calls
    assert (call.name, call.arguments, call.parse_error, call.id) == (
        "calculator",
        raw_args,
        None,
        "call_0",
    )
    assert json.loads(call.arguments) == {"expression": "2 +  3", "precise": True}


def test_hermes_two_calls_and_text_around_them():
    text = (
        "I will check both.\n<tool_call>\n" + CALC + "\n</tool_call> and then "
        '<tool_call>{"name": "search", "parameters": {"query": "x"}}</tool_call> trailing words'
    )
    msg = HermesParser().parse(text)
    assert msg.content == "I will check both."
    assert [c.name for c in msg.tool_calls] == ["calculator", "search"]
    assert [c.id for c in msg.tool_calls] == ["call_0", "call_1"]
    assert msg.tool_calls[1].arguments == '{"query": "x"}'  # "parameters" is accepted
    assert all(c.parse_error is None for c in msg.tool_calls)


def test_hermes_invalid_json_is_a_failed_call():
    inner = '{"name": "calculator", "arguments": {"expression": "2 + 3"}'  # missing brace
    msg = HermesParser().parse(f"<tool_call>\n{inner}\n</tool_call>")
    (call,) = msg.tool_calls
    assert call.name == "calculator"  # still read for the error message
    assert call.arguments == inner
    assert call.parse_error and "invalid JSON" in call.parse_error


def test_hermes_unclosed_tag():
    msg = HermesParser().parse('ok\n<tool_call>\n{"name": "calculator", "arguments": {"expr')
    (call,) = msg.tool_calls
    assert call.parse_error and "unclosed" in call.parse_error
    assert call.name == "calculator"
    assert call.arguments.startswith('{"name": "calculator"')
    assert msg.content == "ok"


def test_hermes_unclosed_then_closed_call():
    text = f'<tool_call>{{"name": "a"<tool_call>{CALC}</tool_call>'
    first, second = HermesParser().parse(text).tool_calls
    assert first.parse_error and "unclosed" in first.parse_error
    assert (second.name, second.parse_error) == ("calculator", None)


@pytest.mark.parametrize(
    ("inner", "error_part"),
    [
        ('{"arguments": {}}', '"name"'),
        ('{"name": 3, "arguments": {}}', '"name"'),
        (CALC + " extra", "unexpected text"),
        ("", "invalid JSON"),
        ("not json at all", "invalid JSON"),
    ],
)
def test_hermes_malformed_calls(inner, error_part):
    (call,) = HermesParser().parse(f"<tool_call>{inner}</tool_call>").tool_calls
    assert call.parse_error and error_part in call.parse_error


def test_hermes_argument_forms():
    p = HermesParser()
    (as_string,) = p.parse(
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    ).tool_calls
    assert as_string.arguments == '{"a": 1}'  # a JSON-encoded string is unwrapped
    (missing,) = p.parse('<tool_call>{"name": "f"}</tool_call>').tool_calls
    assert (missing.arguments, missing.parse_error) == ("{}", None)
    (not_object,) = p.parse('<tool_call>{"name": "f", "arguments": [1]}</tool_call>').tool_calls
    assert not_object.arguments == "[1]"  # the env reports that it is not an object


def test_hermes_call_inside_thinking_is_not_a_call():
    msg = HermesParser().parse(f"<think>maybe <tool_call>{CALC}</tool_call></think>Done.")
    assert msg.tool_calls == ()
    assert msg.content == "Done."


async def test_hermes_parse_error_becomes_env_error_observation():
    from palaestra.envs.calculator import CalculatorEnv

    env = CalculatorEnv()
    env.reset(seed=0)
    action = HermesParser().parse('<tool_call>\n{"name": "calculator", "arguments": {\n')
    obs, reward, terminated, truncated, info = await env.astep(action)
    assert not terminated and info["tool_errors"] == 1
    assert obs[0].role == "tool" and "could not parse the tool call" in obs[0].content


# ----------------------------------------------------------------------------- Llama 3


def test_llama_json_call_message():
    raw = '{"expression": "7*6"}'
    msg = Llama3Parser().parse(f'{{"name": "calculator", "parameters": {raw}}}')
    (call,) = msg.tool_calls
    assert (call.name, call.arguments, call.parse_error, msg.content) == (
        "calculator",
        raw,
        None,
        "",
    )


def test_llama_python_tag_with_two_calls_and_text_before():
    text = (
        'Checking.<|python_tag|>{"name": "a", "parameters": {"x": 1}}; '
        '{"name": "b", "arguments": {"y": 2}}'
    )
    msg = Llama3Parser().parse(text)
    assert msg.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in msg.tool_calls] == [
        ("a", {"x": 1}),
        ("b", {"y": 2}),
    ]


def test_llama_builtin_and_code_interpreter():
    (search,) = (
        Llama3Parser().parse('<|python_tag|>brave_search.call(query="tallest tree")').tool_calls
    )
    assert (search.name, json.loads(search.arguments)) == (
        "brave_search",
        {"query": "tallest tree"},
    )
    (code,) = Llama3Parser().parse("<|python_tag|>print(2 ** 10)").tool_calls
    assert (code.name, json.loads(code.arguments)) == ("python", {"code": "print(2 ** 10)"})


def test_llama_plain_answers_and_broken_calls():
    p = Llama3Parser()
    assert p.parse("The answer is 42.").tool_calls == ()
    assert p.parse('{"result": 42}').content == '{"result": 42}'  # JSON, but not a call
    (broken,) = p.parse('{"name": "calculator", "parameters": {"expression": ').tool_calls
    assert broken.name == "calculator" and "invalid JSON" in broken.parse_error
    (second_broken,) = p.parse(
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": '
    ).tool_calls[1:]
    assert second_broken.parse_error


# ----------------------------------------------------------------------------- Search-R1


def test_search_r1_search_and_answer():
    text = "<think>I need facts.</think>\n<search> capital of France </search>"
    msg = SearchR1Parser().parse(text)
    assert msg.content == text  # the env parses the text itself
    (call,) = msg.tool_calls
    assert (call.name, json.loads(call.arguments), call.parse_error) == (
        "search",
        {"query": "capital of France"},
        None,
    )
    final = SearchR1Parser().parse("<think>known</think>\n<answer> Paris </answer>")
    assert final.tool_calls == () and extract_answer(final.content) == "Paris"


def test_search_r1_broken_tags():
    msg = SearchR1Parser().parse("<search>first</search> <search>second query cut")
    first, second = msg.tool_calls
    assert first.parse_error is None
    assert "unclosed" in second.parse_error and json.loads(second.arguments) == {
        "query": "second query cut"
    }
    assert SearchR1Parser().parse("<think><search>idle</search></think>no search").tool_calls == ()
    assert extract_answer("<answer>unclosed") is None
    assert extract_answer("<answer>1</answer> <answer>2</answer>") == "2"


# ----------------------------------------------------------------------------- python blocks


def test_python_blocks():
    text = (
        "<think>compute it</think>\nFirst:\n```python\nx = 6 * 7\nprint(x)\n```\n"
        "then\n```py\nprint(1)\n```\n```bash\nls\n```"
    )
    msg = PythonBlockParser().parse(text)
    assert msg.reasoning_content == "compute it"
    assert msg.content.startswith("First:")
    assert [json.loads(c.arguments)["code"] for c in msg.tool_calls] == [
        "x = 6 * 7\nprint(x)",
        "print(1)",
    ]
    assert all(c.name == "python" and c.parse_error is None for c in msg.tool_calls)


def test_python_unclosed_block():
    (call,) = PythonBlockParser().parse("```python\nfor i in range(3):\n    print(i)").tool_calls
    assert "unclosed" in call.parse_error
    assert json.loads(call.arguments)["code"] == "for i in range(3):\n    print(i)"
    assert PythonBlockParser().parse("no code here").tool_calls == ()


# ----------------------------------------------------------------------------- robustness

_FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<search>",
    "</search>",
    "<answer>",
    "</answer>",
    "```python\n",
    "```",
    "<|python_tag|>",
    "{",
    "}",
    '"name"',
    ":",
    '"calc"',
    ",",
    '"arguments"',
    '"parameters"',
    "[",
    "]",
    "\\",
    '"',
    "\n",
    " ",
    "text",
    "1",
    ".call(",
    ")",
    "x=",
    "null",
    "é",
    "\x00",
]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(_FRAGMENTS), max_size=30))
def test_parsers_never_raise(parts):
    text = "".join(parts)
    for parser in (HermesParser(), Llama3Parser(), SearchR1Parser(), PythonBlockParser()):
        msg = parser.parse(text)
        assert msg.role == "assistant"
        for call in msg.tool_calls:
            assert isinstance(call.arguments, str)
            if call.parse_error is None:
                assert call.name  # a call without error always has a name

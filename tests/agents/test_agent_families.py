"""The Llama 3, Search-R1 and python-block families through a whole `Agent` episode."""

from __future__ import annotations

import json

import pytest

from palaestra.agents import Agent, get_renderer
from palaestra.errors import TokenDriftError
from palaestra.types import Message


def rendered(tok, family, messages, *, tools=(), gen):
    text = get_renderer(family).render(tok, messages, tools=tools, add_generation_prompt=gen)
    return tok.encode(text, add_special_tokens=False)


def test_llama3_tool_episode_matches_full_re_render(
    llama_tokenizer, sample_llama, calculator_tools
):
    tok = llama_tokenizer
    agent = Agent(tok, "llama3", max_context=2048, strict_drift=True)
    assert agent.marks.close_text == agent.marks.end_text == "<|eot_id|>"
    assert agent.marks.start_text == "<|start_header_id|>"
    stops = agent.stop_token_ids
    assert stops[0] == tok.convert_tokens_to_ids("<|eot_id|>")
    assert tok.convert_tokens_to_ids("<|eom_id|>") in stops

    question = [Message("system", "Be exact."), Message("user", "What is 6 * 7?")]
    agent.start(question, tools=calculator_tools)
    prompt = tok.decode(agent.input_ids)
    assert prompt.startswith("<|begin_of_text|>") and '"name": "calculator"' in prompt

    msg = agent.on_generation(
        sample_llama('{"name": "calculator", "parameters": {"expression": "6 * 7"}}', version=7)
    )
    (call,) = msg.tool_calls
    assert (call.name, json.loads(call.arguments), msg.content) == (
        "calculator",
        {"expression": "6 * 7"},
        "",
    )
    assert agent.on_observation([Message("tool", "42", tool_call_id=call.id)])
    assert agent.input_ids == rendered(
        tok, "llama3", agent.messages, tools=calculator_tools, gen=True
    )
    assert tok.decode(agent.input_ids).endswith(
        "<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    agent.on_generation(sample_llama("It is 42.", version=8))
    assert agent.drift().ok  # arguments go to the template as objects: re-render is exact
    sample = agent.to_sample(reward=1.0, stop_reason="terminated")
    sample.validate(vocab_size=len(tok))
    assert set(sample.versions_T) == {-1, 7, 8}


def test_llama3_two_calls_fall_back_when_the_template_refuses(llama_tokenizer, sample_llama):
    tok = llama_tokenizer
    agent = Agent(tok, "llama3", max_context=2048, strict_drift=True)
    agent.start([Message("user", "Add and multiply 6 and 7.")])
    msg = agent.on_generation(
        sample_llama(
            '<|python_tag|>{"name": "add", "parameters": {"a": 6, "b": 7}}; '
            '{"name": "mul", "parameters": {"a": 6, "b": 7}}'
        )
    )
    assert [c.name for c in msg.tool_calls] == ["add", "mul"]
    turn_end = len(agent.input_ids)
    # Meta-style templates raise on two calls; the delta comes from the base conversation
    assert agent.on_observation([Message("tool", "13"), Message("tool", "42")])
    assert agent.metrics()["delta_fallbacks"] == 1
    assert tok.decode(agent.input_ids[turn_end:]) == (
        "<|start_header_id|>ipython<|end_header_id|>\n\n13<|eot_id|>"
        "<|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    with pytest.raises(TokenDriftError, match="re-render failed"):
        agent.drift()  # the conversation cannot be re-rendered at all: reported, not hidden


def test_llama3_eom_ends_the_turn(llama_tokenizer, sample_llama):
    tok = llama_tokenizer
    eom = tok.convert_tokens_to_ids("<|eom_id|>")
    agent = Agent(tok, "llama3", max_context=1024)
    agent.start([Message("user", "Search for trees.")])
    gen = sample_llama('<|python_tag|>brave_search.call(query="trees")', end_id=eom)
    msg = agent.on_generation(gen)
    assert msg.tool_calls[0].name == "brave_search"
    n = len(agent.input_ids)
    agent.on_observation([Message("tool", "Trees are tall.")])
    # the model closed its turn with <|eom_id|>: no <|eot_id|> is added after it
    assert tok.decode(agent.input_ids[n - 1 : n + 5]).startswith(
        "<|eom_id|><|start_header_id|>ipython"
    )


def test_search_r1_episode(tokenizer, sample_text):
    agent = Agent(tokenizer, "search_r1", max_context=2048, strict_drift=True)
    prompt = Message(
        "user", "Answer the question. Use <search>query</search> to search. Q: capital of France?"
    )
    agent.start([prompt], tools=[{"type": "function", "function": {"name": "search"}}])
    assert "<tools>" not in tokenizer.decode(agent.input_ids)  # the prompt describes the protocol
    text = "I should look it up. <search>capital of France</search>"
    msg = agent.on_generation(sample_text(text, end=False, finish_reason="stop"))  # stop string
    assert msg.content == text and json.loads(msg.tool_calls[0].arguments) == {
        "query": "capital of France"
    }
    assert agent.on_observation(
        [Message("user", "<information>Doc 1: Paris is the capital.</information>")]
    )
    agent.on_generation(sample_text("<answer>Paris</answer>"))
    assert agent.drift().ok  # calls live in the text: the template does not re-render them


def test_python_block_episode(tokenizer, sample_text):
    agent = Agent(tokenizer, "python", max_context=2048, strict_drift=True)
    agent.start([Message("user", "Compute 2 ** 10 with python.")])
    msg = agent.on_generation(sample_text("Running:\n```python\nprint(2 ** 10)\n```"))
    (call,) = msg.tool_calls
    assert (call.name, json.loads(call.arguments)) == ("python", {"code": "print(2 ** 10)"})
    assert agent.on_observation([Message("tool", "1024", tool_call_id=call.id)])
    assert agent.input_ids == rendered(tokenizer, "python", agent.messages, gen=True)
    agent.on_generation(sample_text("The result is 1024."))
    assert agent.drift().ok

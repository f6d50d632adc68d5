"""Demonstrations become samples in exactly the layout of an RL episode of the same conversation."""

import pytest

from palaestra.agents import AgentSpec
from palaestra.agents.demonstrations import demonstration_to_sample
from palaestra.errors import ConfigError
from palaestra.engine import Generation
from palaestra.types import Message

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "d", "parameters": {}}}]
CALL = {"id": "call_0_0", "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "2 * 3"}'}}
DIALOGUE = [
    {"role": "system", "content": "Use the calculator."},
    {"role": "user", "content": "What is 2 * 3?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "6", "tool_call_id": "call_0_0", "name": "calculator"},
    {"role": "assistant", "content": "<answer>6</answer>"},
]


def test_mask_covers_exactly_the_assistant_turns(tokenizer_dir):
    agent = AgentSpec(str(tokenizer_dir)).build()
    sample = demonstration_to_sample(agent, DIALOGUE, TOOLS)
    tok = agent.tokenizer
    trained = tok.decode([t for t, m in zip(sample.token_ids_T, sample.loss_mask_T) if m])
    assert trained == (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 * 3"}}\n</tool_call>'
        "<|im_end|><answer>6</answer><|im_end|>"
    )
    assert agent.drift().ok  # the replayed ids equal a full re-render of the conversation
    assert len(sample.turn_ends) == 2 and sample.prompt_len < sample.turn_ends[0]


def test_same_ids_as_an_rl_episode_that_sampled_the_same_text(tokenizer_dir):
    """An RL agent fed the demonstration's assistant tokens ends with the identical sample."""
    spec = AgentSpec(str(tokenizer_dir))
    demo = demonstration_to_sample(spec.build(), DIALOGUE, TOOLS)
    rl = spec.build()
    rl.start([Message.from_dict(m) for m in DIALOGUE[:2]], TOOLS)
    ends = demo.turn_ends
    first = demo.token_ids_T[demo.prompt_len : ends[0]]
    rl.on_generation(Generation(first, (-0.1,) * len(first), "stop"))
    rl.on_observation([Message.from_dict(DIALOGUE[3])])
    start2 = len(rl.input_ids)
    second = demo.token_ids_T[start2 : ends[1]]
    rl.on_generation(Generation(second, (-0.1,) * len(second), "stop"))
    assert tuple(rl.input_ids) == demo.token_ids_T


def test_demonstration_needs_a_prompt_and_an_answer(tokenizer_dir):
    agent = AgentSpec(str(tokenizer_dir)).build()
    with pytest.raises(ConfigError, match="prompt messages followed by an assistant turn"):
        demonstration_to_sample(agent, [{"role": "user", "content": "hi"}])

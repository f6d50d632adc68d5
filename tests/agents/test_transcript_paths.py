"""The rollout's `Agent` and the agent gateway's `Session` record the same tokens for the same
conversation: both go through one `ChatTemplate.delta` and one `TokenTranscript`."""

from __future__ import annotations

import pytest

from palaestra.agents import Agent, ChatTemplate, TemplateDeltaError, TokenTranscript
from palaestra.errors import EngineError
from palaestra.engine import SamplingParams
from palaestra.rollout.gateway.session import Session, SessionLimits
from palaestra.rollout.gateway.template import ChatTokens
from palaestra.types import Message

SYSTEM = Message("system", "You are a calculator.")
QUESTION = Message("user", "What is 6 * 7?")
CALL = '<think>I should use the tool.</think><tool_call>\n{"name": "add", "arguments": {"a": 6, "b": 36}}\n</tool_call>'
TOOL = Message("tool", "42", tool_call_id="call_0_0", name="add")
FOLLOW_UP = Message("user", "And 6 * 8?")


def _play_both(tokenizer, family, sampler, tools, turns):
    """Play ``turns`` [(sampled text, observation after it)] through an Agent and a Session."""
    agent = Agent(tokenizer, family, max_context=4096)
    agent.start([SYSTEM, QUESTION], tools)
    session = Session("s", ChatTokens(tokenizer, family), SamplingParams(), SessionLimits())
    messages = [SYSTEM, QUESTION]
    kinds = []
    for k, (text, observation) in enumerate(turns):
        gen = sampler(text, version=k)
        agent.on_generation(gen)
        plan = session.plan(messages, tools)
        kinds.append(plan.kind)
        wire, _ = session.chat.reply(list(gen.token_ids), session.calls)
        reply = Message.from_dict(wire)
        session.commit(plan, tools, reply, gen.token_ids, gen.logprobs,
                       [gen.weight_version] * len(gen.token_ids))
        if observation is not None:
            assert agent.on_observation(observation)
            messages = [*messages, reply, *observation]
    assert len(session.samples) == 1, session.break_reasons
    return agent, session.samples[0].tokens, kinds


@pytest.mark.parametrize("family", ["qwen", "llama3"])
def test_agent_and_gateway_record_identical_tokens(
    family, tokenizer, llama_tokenizer, sample_text, sample_llama, calculator_tools
):
    tok, sampler = (tokenizer, sample_text) if family == "qwen" else (llama_tokenizer, sample_llama)
    call = CALL if family == "qwen" else '{"name": "add", "parameters": {"a": 6, "b": 36}}'
    turns = [(call, [TOOL]), ("The answer is 42.", [FOLLOW_UP]), ("48.", None)]
    agent, tokens, kinds = _play_both(tok, family, sampler, calculator_tools, turns)
    ours = agent.transcript
    assert tokens.ids == ours.ids
    assert tokens.mask == ours.mask
    assert tokens.logprobs == ours.logprobs
    assert tokens.versions == ours.versions
    assert tokens.prompt_len == ours.prompt_len
    assert tokens.turn_ends == ours.turn_ends
    assert kinds[0] == "new" and set(kinds[1:]) <= {"exact", "reconciled"}
    if family == "qwen":  # the reasoning of turn 1 is dropped once the user speaks again:
        assert agent.metrics()["delta_fallbacks"] >= 1  # the base-conversation delta ran
        assert "reconciled" in kinds
        assert agent.drift().mismatches > 0  # and a full re-render differs, as it should
    else:  # an append-only template: the tokens are exactly a full re-render's
        assert agent.drift().mismatches == 0


def test_delta_of_one_template_is_what_both_callers_append(tokenizer, sample_text):
    template = ChatTemplate(tokenizer, "qwen")
    agent = Agent(tokenizer, "qwen")
    agent.start([QUESTION])
    gen = sample_text("Let me think.")
    agent.on_generation(gen)
    before = len(agent.transcript)
    agent.on_observation([FOLLOW_UP])
    delta = template.delta(agent.messages[:-1], [FOLLOW_UP], (), closed=True)
    assert agent.transcript.ids[before:] == delta.ids
    assert ChatTokens(tokenizer, "qwen").tail_ids(agent.messages[:-1], [FOLLOW_UP], (),
                                                   closed=True) == delta.ids


def test_unclosed_turn_gets_the_closing_text_in_its_delta(tokenizer, sample_text):
    template = ChatTemplate(tokenizer, "qwen")
    conv = [QUESTION, Message("assistant", "cut sho")]
    closed = template.delta(conv, [FOLLOW_UP], (), closed=True).ids
    unclosed = template.delta(conv, [FOLLOW_UP], (), closed=False).ids
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert unclosed[0] == end and unclosed[1:] == closed


def test_template_that_cannot_render_an_observation_raises(llama_tokenizer):
    template = ChatTemplate(llama_tokenizer, "llama3")
    from palaestra.types import ToolCall

    two_calls = Message("assistant", "", tool_calls=(ToolCall("a", "{}", "1"), ToolCall("b", "{}", "2")))
    with pytest.raises(TemplateDeltaError, match="cannot render"):
        template.delta([QUESTION], [two_calls], (), closed=True)
    assert ChatTokens(llama_tokenizer, "llama3").tail_ids([QUESTION], [two_calls], (),
                                                          closed=True) is None


def test_transcript_masks_and_refuses_mismatched_logprobs():
    t = TokenTranscript()
    t.append_prompt([1, 2, 3])
    t.append_sampled([4, 5], [-0.1, -0.2], 3)
    t.append_context([6])
    t.append_sampled([7], [-0.3], [4])
    assert (t.ids, t.mask, t.versions) == ([1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 1, 1, 0, 1],
                                           [-1, -1, -1, 3, 3, -1, 4])
    assert t.prompt_len == 3 and t.num_sampled == 3
    with pytest.raises(EngineError, match="logprob"):
        t.append_sampled([8, 9], [-0.1], 0)
    with pytest.raises(EngineError, match="versions"):
        t.append_sampled([8, 9], [-0.1, -0.2], [1])
    sample = t.to_sample(reward=1.0, stop_reason="terminated")
    assert sample.token_ids_T == tuple(t.ids) and sample.logprobs_T[3] == -0.1

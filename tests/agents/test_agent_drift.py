"""Token drift: incremental ids vs a full re-render, on the Qwen-style template with thinking."""

from __future__ import annotations

import pytest

from palaestra.agents import Agent, compare_ids, get_renderer
from palaestra.errors import TokenDriftError
from palaestra.engine import Generation
from palaestra.types import Message

QUESTION = Message("user", "What is 12 * 7 + 3?")
THINK = "<think>\nmultiply first, then add\n</think>\n\n"


def reference_ids(tok, messages, *, gen):
    text = get_renderer("qwen").render(tok, messages, add_generation_prompt=gen)
    return tok.encode(text, add_special_tokens=False)


def test_compare_ids():
    assert compare_ids([1, 2, 3], [1, 2, 3]).ok
    dropped = compare_ids([1, 2, 9, 9, 9, 3, 4], [1, 2, 3, 4])
    assert (dropped.mismatches, dropped.first_mismatch) == (3, 2)  # only the dropped block counts
    assert compare_ids([1, 2], [1, 2, 3]).first_mismatch == 2
    swapped = compare_ids([1, 5, 3], [1, 6, 3], decode=lambda ids: ",".join(map(str, ids)))
    assert (swapped.mismatches, swapped.incremental_excerpt, swapped.reference_excerpt) == (
        1,
        "1,5,3",
        "1,6,3",
    )
    with pytest.raises(TokenDriftError, match="1 tokens differ"):
        swapped.raise_if_drift()
    # message by message (separator 0): two drifts in different messages, 1 + 2 tokens
    by_message = compare_ids(
        [0, 1, 7, 2, 0, 3, 4, 0, 5, 8, 8], [0, 1, 2, 0, 3, 4, 0, 5], separators={0}
    )
    assert (by_message.mismatches, by_message.first_mismatch) == (3, 2)
    # a different number of messages falls back to one global comparison
    assert compare_ids([0, 1, 0, 2], [0, 1, 2], separators={0}).mismatches == 1


def test_long_episode_drift_is_counted_per_turn(tokenizer, sample_text):
    """Text after a tool call is not part of the message, so each turn drifts by its tail."""
    agent = Agent(tokenizer, max_context=20000)
    agent.start([QUESTION])
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 1"}}\n</tool_call>'
    tail = " and then some words"
    tail_ids = tokenizer.encode(tail, add_special_tokens=False)
    for _ in range(30):
        msg = agent.on_generation(sample_text(call + tail))
        assert agent.on_observation([Message("tool", "2 " * 40, tool_call_id=msg.tool_calls[0].id)])
    agent.on_generation(sample_text("done"))
    assert agent.metrics()["delta_fallbacks"] == 0
    report = agent.drift()
    assert report.mismatches == 30 * len(tail_ids)
    first_turn_tail = agent.prompt_len + len(tokenizer.encode(call, add_special_tokens=False))
    assert report.first_mismatch == first_turn_tail


def test_thinking_dropped_by_re_render_is_reported(tokenizer, sample_text):
    agent = Agent(tokenizer, max_context=1024, drift_check=True)
    agent.start([QUESTION])
    first = agent.on_generation(sample_text(THINK + "It is 87."))
    assert (first.reasoning_content, first.content) == ("multiply first, then add", "It is 87.")
    turn1_start = agent.prompt_len
    # a new user query: the template now drops turn 1's reasoning, so the conversation's text no
    # longer extends the previous rendering and the delta comes from the fixed base conversation
    assert agent.on_observation([Message("user", "Explain why.")])
    assert agent.metrics()["delta_fallbacks"] == 1
    agent.on_generation(sample_text("12 times 7 is 84, plus 3 is 87."))

    report = agent.drift()
    think_ids = tokenizer.encode(THINK, add_special_tokens=False)
    assert not report.ok
    assert report.first_mismatch == turn1_start
    assert report.mismatches == len(think_ids)
    assert "<think>" in report.incremental_excerpt and "<think>" not in report.reference_excerpt

    # everything but the dropped reasoning is token-identical to the re-render, the fallback
    # delta included
    ids = agent.input_ids
    assert ids[turn1_start : turn1_start + len(think_ids)] == think_ids
    without_think = ids[:turn1_start] + ids[turn1_start + len(think_ids) :]
    reference = reference_ids(tokenizer, agent.messages, gen=False)
    assert without_think + tokenizer.encode("\n", add_special_tokens=False) == reference

    sample = agent.to_sample(reward=1.0, stop_reason="terminated")
    assert sample.metrics["drift_mismatches"] == len(think_ids)
    assert sample.token_ids_T == tuple(ids)  # training data keeps what was sampled


def test_strict_drift_raises(tokenizer, sample_text):
    agent = Agent(tokenizer, max_context=1024, strict_drift=True)
    agent.start([QUESTION])
    agent.on_generation(sample_text(THINK + "87"))
    agent.on_observation([Message("user", "Sure?")])
    agent.on_generation(sample_text("Yes."))
    with pytest.raises(TokenDriftError, match="differ from a full re-render"):
        agent.drift()


def test_strict_drift_in_to_sample(tokenizer, sample_text):
    agent = Agent(tokenizer, max_context=1024, drift_check=True, strict_drift=True)
    agent.start([QUESTION])
    agent.on_generation(sample_text(THINK + "87"))
    agent.on_observation([Message("user", "Sure?")])
    agent.on_generation(sample_text("Yes."))
    with pytest.raises(TokenDriftError):
        agent.to_sample(reward=0.0, stop_reason="terminated")


def test_thinking_kept_across_tool_turns_has_no_drift(tokenizer, sample_text, calculator_tools):
    agent = Agent(tokenizer, max_context=2048, strict_drift=True)
    agent.start([QUESTION], tools=calculator_tools)
    call = (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7 + 3"}}\n'
        "</tool_call>"
    )
    msg = agent.on_generation(sample_text(THINK + call))
    assert msg.reasoning_content and msg.tool_calls[0].name == "calculator"
    assert agent.on_observation([Message("tool", "87", tool_call_id=msg.tool_calls[0].id)])
    agent.on_generation(sample_text("<think>\ncopy it\n</think>\n\n<answer>87</answer>"))
    # tool results are not a new user query: the template keeps both reasoning blocks
    assert agent.drift().ok and agent.metrics()["delta_fallbacks"] == 0


def test_non_canonical_sampled_split_is_kept_and_reported(tokenizer):
    words = ["question", "answer", "calculate", "information", "document", "difference"]
    found = None
    for word in words:
        canonical = tokenizer.encode(word, add_special_tokens=False)
        for k in range(1, len(word)):
            split = tokenizer.encode(word[:k], add_special_tokens=False) + tokenizer.encode(
                word[k:], add_special_tokens=False
            )
            if split != canonical:
                found = (word, split)
                break
        if found:
            break
    assert found, "the tiny tokenizer merges none of the words"
    word, split = found
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = (*split, end)
    agent = Agent(tokenizer, max_context=512)
    agent.start([QUESTION])
    msg = agent.on_generation(Generation(ids, tuple(-0.1 for _ in ids), "stop"))
    assert msg.content == word
    assert tuple(agent.input_ids[agent.prompt_len :]) == ids  # never re-tokenized
    assert agent.drift().mismatches > 0


def test_template_that_rewrites_the_last_turn(tokenizer, sample_text, calculator_tools):
    """Like Qwen3's own template: the last assistant turn always gets a (possibly empty) think
    block, so the conversation's text never simply grows; the fixed base conversation gives the
    delta, and the drift check reports the empty block of the final turn."""
    from palaestra.chat_template import QWEN_STYLE_TEMPLATE

    rule = "{% if reasoning and loop.index0 > ns.last_query %}"
    assert rule in QWEN_STYLE_TEMPLATE
    template = QWEN_STYLE_TEMPLATE.replace(
        rule, "{% if loop.index0 > ns.last_query and (reasoning or loop.last) %}"
    )
    renderer = get_renderer("qwen").with_template(template)
    agent = Agent(tokenizer, renderer, max_context=2048)
    agent.start([QUESTION], tools=calculator_tools)
    call = (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7+3"}}\n</tool_call>'
    )
    msg = agent.on_generation(sample_text(call))
    assert agent.on_observation([Message("tool", "87", tool_call_id=msg.tool_calls[0].id)])
    assert agent.metrics()["delta_fallbacks"] == 1
    text = renderer.render(
        tokenizer, agent.messages, tools=calculator_tools, add_generation_prompt=True
    )
    assert agent.input_ids == tokenizer.encode(text, add_special_tokens=False)
    agent.on_generation(sample_text("It is 87."))
    report = agent.drift()
    empty_think = tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    assert report.mismatches == len(empty_think)


async def test_pooled_agents_check_drift_at_the_configured_rate(tokenizer_dir):
    """Workers reuse agents across episodes; each episode is checked with probability
    ``drift_rate`` (drawn once, in `Agent.start`), not ``drift_rate**2``."""
    from palaestra.agents import AgentSpec
    from palaestra.rollout.config import EngineSpec, RolloutConfig, WorkerConfig
    from palaestra.rollout.data import DataSource
    from palaestra.rollout.manager import RolloutManager
    from palaestra.engine import SamplingParams
    from palaestra.engines.clients.scripted import ScriptedEngine
    from palaestra.rollout.testing import CalculatorPolicy

    rows = [{"env_id": "palaestra/Calculator-v0", "id": f"t{i}", "question": f"What is {i} + 1?",
             "answer": str(i + 1)} for i in range(100)]
    engine = ScriptedEngine(CalculatorPolicy(str(tokenizer_dir)))
    spec = AgentSpec(str(tokenizer_dir), drift_rate=0.5)
    wc = WorkerConfig(engine=EngineSpec(), agent=spec, sampling=SamplingParams(max_new_tokens=64))
    cfg = RolloutConfig(batch_size=10, group_size=4, num_workers=1, max_concurrency=8)
    checked = []
    async with RolloutManager(DataSource(rows), wc, cfg, cluster="local", engine=engine) as m:
        for step in range(10):  # 400 episodes, played by at most 8 (then reused) agents
            batch = await m.generate_batch(step)
            checked += [s.metrics["drift_checked"] for s in batch.samples]
    assert len(checked) == 400
    rate = sum(checked) / len(checked)
    # binomial(400, 0.5): sd 0.025; the squared rate (0.25) is 10 sd away
    assert abs(rate - 0.5) < 0.1, rate

"""`Agent` over scripted multi-turn conversations with the tiny Qwen-style tokenizer."""

from __future__ import annotations

import json
import random

import pytest

from palaestra.agents import Agent, get_renderer
from palaestra.errors import ConfigError, EngineError, RolloutError, TokenDriftError
from palaestra.engine import Generation
from palaestra.types import Message, Sample, StopReason, ToolCall

SYSTEM = Message("system", "Use the calculator, then answer with <answer>N</answer>.")
QUESTION = Message("user", "What is 12 * 7 + 3?")


def render_ids(tok, messages, *, tools=(), gen, **kw):
    text = get_renderer("qwen").render(tok, messages, tools=tools, add_generation_prompt=gen, **kw)
    return tok.encode(text, add_special_tokens=False)


def call_text(name, args):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def tool_msg(content, call):
    return Message("tool", content, tool_call_id=call.id, name=call.name)


def test_multi_turn_tokens_masks_logprobs_versions(tokenizer, sample_text, calculator_tools):
    agent = Agent(tokenizer, "qwen", max_context=2048)
    assert (agent.marks.close_text, agent.marks.end_text, agent.marks.start_text) == (
        "<|im_end|>\n",
        "<|im_end|>",
        "<|im_start|>",
    )
    agent.start([SYSTEM, QUESTION], tools=calculator_tools)
    assert agent.input_ids == render_ids(
        tokenizer, [SYSTEM, QUESTION], tools=calculator_tools, gen=True
    )
    prompt_len = len(agent.input_ids)

    gens = [
        sample_text(
            "Let me compute.\n" + call_text("calculator", {"expression": "12 * 7"}), version=3
        ),
        sample_text(
            call_text("calculator", {"expression": "84 + 3"})
            + "\n"
            + call_text("calculator", {"expression": "3 + 84"}),
            version=4,
        ),
        sample_text("Both give 87. <answer>87</answer>", version=5),
    ]
    spans = []
    first = agent.on_generation(gens[0])
    spans.append((prompt_len, len(agent.input_ids)))
    assert first.content == "Let me compute."
    assert [(c.name, json.loads(c.arguments)) for c in first.tool_calls] == [
        ("calculator", {"expression": "12 * 7"})
    ]
    assert agent.on_observation([tool_msg("84", first.tool_calls[0])])
    # delta rendering: the ids equal a full re-render (+ generation prompt) at every boundary
    assert agent.input_ids == render_ids(
        tokenizer, agent.messages, tools=calculator_tools, gen=True
    )

    start = len(agent.input_ids)
    second = agent.on_generation(gens[1])
    spans.append((start, len(agent.input_ids)))
    assert [c.id for c in second.tool_calls] == ["call_1_0", "call_1_1"]  # unique per episode
    assert agent.on_observation([tool_msg("87", c) for c in second.tool_calls])
    assert agent.input_ids == render_ids(
        tokenizer, agent.messages, tools=calculator_tools, gen=True
    )

    start = len(agent.input_ids)
    final = agent.on_generation(gens[2])
    spans.append((start, len(agent.input_ids)))
    assert final.content == "Both give 87. <answer>87</answer>" and final.tool_calls == ()
    assert [m.role for m in agent.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "tool",
        "assistant",
    ]

    ids, mask, lps, vers = agent.input_ids, agent.loss_mask, agent.logprobs, agent.versions
    sampled_positions = {i for a, b in spans for i in range(a, b)}
    assert {i for i, m in enumerate(mask) if m} == sampled_positions  # mask = exactly the sampled
    for (a, b), gen in zip(spans, gens, strict=True):
        assert tuple(ids[a:b]) == gen.token_ids  # appended exactly as returned
        assert lps[a:b] == gen.logprobs  # logprobs aligned
        assert set(vers[a:b]) == {gen.weight_version}
    assert all(
        lps[i] == 0.0 and vers[i] == -1 for i in range(len(ids)) if i not in sampled_positions
    )

    sample = agent.to_sample(
        reward=1.0,
        turn_rewards=(0.0, 0.0, 1.0),
        stop_reason=StopReason.TERMINATED,
        env_id="palaestra/Calculator-v0",
        task_id="t1",
        group_id="g1",
    )
    sample.validate(vocab_size=len(tokenizer))
    assert isinstance(sample, Sample)
    assert sample.prompt_len == prompt_len
    assert sample.turn_ends == tuple(b for _, b in spans)
    assert sample.num_sampled == sum(len(g.token_ids) for g in gens)
    assert (sample.min_version, sample.turn_rewards, sample.task_id) == (3, (0.0, 0.0, 1.0), "t1")
    assert sample.metrics["num_turns"] == 3 and sample.metrics["delta_fallbacks"] == 0
    assert sample.metrics["drift_checked"] == 0.0  # drift_check is off
    assert "drift_mismatches" not in sample.metrics
    assert agent.drift().ok  # no thinking: incremental ids == full re-render


def test_generation_without_end_token_is_closed_with_mask_0(tokenizer, sample_text):
    agent = Agent(tokenizer, max_context=1024)
    agent.start([QUESTION])
    gen = sample_text("I think it is", end=False)  # cut by max_new_tokens
    agent.on_generation(gen)
    end = len(agent.input_ids)
    assert agent.on_observation([Message("user", "Please finish.")])
    assert agent.input_ids[end] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert agent.loss_mask[end] == 0
    assert agent.input_ids == render_ids(tokenizer, agent.messages, gen=True)
    agent.on_generation(sample_text("It is 87."))
    assert agent.drift().ok


async def test_calculator_env_episode_end_to_end(tokenizer, sample_text):
    from palaestra.envs.calculator import CalculatorEnv

    env = CalculatorEnv()
    obs, _ = await env.areset(seed=3)
    agent = Agent(tokenizer, "qwen", max_context=2048, drift_check=True, strict_drift=True)
    agent.start(obs, tools=env.tool_schemas())
    expression, answer = env.task["expression"], env.task["answer"]
    script = [
        sample_text(call_text("calculator", {"expression": expression}), version=1),
        sample_text('broken\n<tool_call>\n{"name": "calculator", "arguments": {', version=1),
        sample_text(f"<answer>{answer}</answer>", version=2),
    ]
    rewards = []
    for gen in script:
        action = agent.on_generation(gen)
        obs, reward, terminated, truncated, info = await env.astep(action)
        rewards.append(reward)
        if terminated or truncated:
            break
        assert agent.on_observation(obs)
    assert agent.messages[3].content == answer  # the tool result
    assert "could not parse" in agent.messages[5].content  # the broken call's error observation
    assert rewards[-1] == 1.0 and terminated
    # the unclosed call re-renders differently from what was sampled: strict drift raises
    with pytest.raises(TokenDriftError):
        agent.to_sample(reward=1.0, turn_rewards=rewards, stop_reason="terminated")
    agent.strict_drift = False
    sample = agent.to_sample(reward=1.0, turn_rewards=rewards, stop_reason="terminated")
    assert sample.metrics["drift_checked"] == 1.0 and sample.metrics["drift_mismatches"] > 0
    sample.validate(vocab_size=len(tokenizer))


def test_user_follow_up_and_empty_observation(tokenizer, sample_text):
    agent = Agent(tokenizer, max_context=1024)
    agent.start([SYSTEM, QUESTION])
    agent.on_generation(sample_text("87"))
    assert agent.on_observation([Message("user", "Are you sure?")])
    agent.on_generation(sample_text("Yes."))
    assert agent.on_observation([])  # no new message: just the next generation prompt
    assert agent.input_ids == render_ids(tokenizer, agent.messages, gen=True)
    agent.on_generation(sample_text("Still 87."))
    assert agent.drift().ok and agent.metrics()["delta_fallbacks"] == 0


def test_enable_thinking_false_prompt(tokenizer):
    agent = Agent(tokenizer, max_context=1024, enable_thinking=False)
    agent.start([QUESTION])
    tail = tokenizer.decode(agent.input_ids)
    assert tail.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert agent.stop_token_ids[0] == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_abort_and_resume_continues_the_turn(tokenizer, sample_text):
    agent = Agent(tokenizer, max_context=1024)
    agent.start([QUESTION])
    full = sample_text(call_text("calculator", {"expression": "12 * 7 + 3"}))
    k = len(full.token_ids) // 2
    part1 = Generation(full.token_ids[:k], full.logprobs[:k], "abort", weight_version=1)
    part2 = Generation(full.token_ids[k:], full.logprobs[k:], "stop", weight_version=2)
    first = agent.on_generation(part1)
    assert first.tool_calls[0].parse_error  # half a call: unclosed
    msg = agent.on_generation(part2)  # resumed after the weight update
    assert msg.tool_calls[0].parse_error is None and msg.tool_calls[0].id == "call_0_0"
    assert len(agent.messages) == 2 and agent.turn_ends == [len(agent.input_ids)]
    start = agent.prompt_len
    assert agent.versions[start : start + k] == (1,) * k
    assert set(agent.versions[start + k :]) == {2}
    with pytest.raises(RolloutError):
        agent.on_generation(full)  # a finished turn is not continued


def test_context_limit_truncates_instead_of_crashing(tokenizer, sample_text):
    agent = Agent(tokenizer, max_context=60)
    agent.start([QUESTION])
    agent.on_generation(sample_text(call_text("calculator", {"expression": "12 * 7"})))
    before_ids, before_msgs = agent.input_ids, list(agent.messages)
    call = agent.messages[-1].tool_calls[0]
    assert agent.on_observation([tool_msg("8" * 200, call)]) is False
    assert agent.input_ids == before_ids and agent.messages == before_msgs  # nothing appended
    assert agent.truncated
    sample = agent.to_sample(reward=0.0, stop_reason=StopReason.TRUNCATED)
    assert sample.stop_reason is StopReason.TRUNCATED and sample.metrics["truncated"] == 1.0
    sample.validate(vocab_size=len(tokenizer))

    tight = Agent(tokenizer, max_context=10)
    tight.start([QUESTION])  # the prompt alone is too long: flagged, not raised
    assert tight.truncated and tight.remaining_context() < 0
    tight.to_sample(reward=0.0, stop_reason="truncated").validate()

    long_gen = Agent(tokenizer, max_context=30)
    long_gen.start([QUESTION])
    long_gen.on_generation(sample_text("word " * 40, end=False))  # engine overshot the budget
    assert long_gen.truncated and long_gen.remaining_context() < 0


def test_observation_fits_exactly_when_room_is_left(tokenizer, sample_text):
    probe = Agent(tokenizer, max_context=4096)
    probe.start([QUESTION])
    probe.on_generation(sample_text("87"))
    probe.on_observation([Message("user", "again")])
    needed = len(probe.input_ids)
    ok = Agent(tokenizer, max_context=needed + 1)
    ok.start([QUESTION])
    ok.on_generation(sample_text("87"))
    assert ok.on_observation([Message("user", "again")]) and ok.remaining_context() == 1
    full = Agent(tokenizer, max_context=needed)
    full.start([QUESTION])
    full.on_generation(sample_text("87"))
    assert not full.on_observation([Message("user", "again")])  # no room left to sample


def test_misuse_gives_clear_errors(tokenizer, sample_text):
    agent = Agent(tokenizer)
    with pytest.raises(RolloutError, match="start"):
        agent.on_generation(sample_text("x"))
    with pytest.raises(ConfigError):
        agent.start([])
    agent.start([QUESTION])
    with pytest.raises(RolloutError, match="on_generation"):
        agent.on_observation([Message("user", "hi")])
    with pytest.raises(EngineError, match="logprob"):
        agent.on_generation(Generation((5, 6), (), "stop"))
    agent.on_generation(sample_text("x"))
    with pytest.raises(RolloutError, match="on_observation"):
        agent.on_generation(sample_text("y"))
    with pytest.raises(ConfigError, match="unknown agent family"):
        Agent(tokenizer, "gpt-2000")
    with pytest.raises(ConfigError):
        Agent(tokenizer, max_context=0)


def test_input_ids_is_a_copy_and_start_resets(tokenizer, sample_text):
    agent = Agent(tokenizer)
    agent.start([QUESTION])
    ids = agent.input_ids
    ids.append(1)
    assert len(agent.input_ids) == len(ids) - 1
    agent.on_generation(sample_text("x"))
    agent.start([QUESTION])  # a new episode
    assert agent.messages == [QUESTION] and sum(agent.loss_mask) == 0 and agent.turn_ends == []


def test_random_tokens_never_crash(tokenizer, calculator_tools):
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(8):
        agent = Agent(tokenizer, max_context=400)
        agent.start([QUESTION], tools=calculator_tools)
        for turn in range(4):
            n = rng.randint(0, 30)
            ids = tuple(rng.randrange(vocab) for _ in range(n))
            lps = tuple(-rng.random() for _ in ids)
            msg = agent.on_generation(Generation(ids, lps, rng.choice(["stop", "length"]), turn))
            assert msg.role == "assistant"
            obs = [
                Message("tool", "r" * rng.randint(0, 50), tool_call_id=c.id) for c in msg.tool_calls
            ]
            if not agent.on_observation(obs or [Message("user", "go on")]):
                break
        sample = agent.to_sample(
            reward=0.0, stop_reason="truncated" if agent.truncated else "terminated"
        )
        sample.validate(vocab_size=vocab)
        assert sample.num_sampled == sum(1 for v in sample.versions_T if v >= 0)
        report = agent.drift()
        assert report.mismatches >= 0


def test_tool_call_parse_errors_reach_the_template_safely(tokenizer, sample_text, calculator_tools):
    """A message holding a failed call still renders (drift counted), never raises."""
    agent = Agent(tokenizer, max_context=1024)
    agent.start([QUESTION], tools=calculator_tools)
    msg = agent.on_generation(sample_text("<tool_call>\n{not json}\n</tool_call>"))
    assert msg.tool_calls == (
        ToolCall(
            name="",
            arguments="{not json}",
            id="call_0_0",
            parse_error=msg.tool_calls[0].parse_error,
        ),
    )
    turn_end = len(agent.input_ids)
    assert agent.on_observation(
        [Message("tool", "Error: could not parse", tool_call_id="call_0_0")]
    )
    delta = agent.input_ids[turn_end:]
    reference = render_ids(tokenizer, agent.messages, tools=calculator_tools, gen=True)
    assert reference[-len(delta) :] == delta  # the delta is still the re-render's boundary
    report = agent.drift()  # the failed call re-renders as '{"name": "", ...}': drift inside it
    assert not report.ok and agent.prompt_len <= report.first_mismatch < turn_end

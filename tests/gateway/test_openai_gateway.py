"""The gateway's OpenAI routes with the real `openai` client, a real `LocalEngine` on the micro
model and a real aiohttp server on loopback: token-exact samples, continuation, prefix breaks,
streaming, sessions and limits."""

from __future__ import annotations

import json

import openai
import pytest

from palaestra.engine import SamplingParams
from palaestra.rollout.gateway.gateway import Gateway
from palaestra.rollout.gateway.server import serve_gateway
from palaestra.types import Message

SYSTEM = {"role": "system", "content": "You are terse."}
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "evaluate arithmetic",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]


def client_for(server, sid: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url(sid), api_key="x", max_retries=0)


def echo(message) -> dict:
    """The assistant message as an agent sends it back (what most OpenAI agents do)."""
    out = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in message.tool_calls]
    return out


def sampled(sample) -> list[int]:
    return [t for t, m in zip(sample.token_ids_T, sample.loss_mask_T) if m]


async def test_five_turns_give_one_sample_with_the_engine_tokens(served, tokenizer):
    gateway, server, rec = served
    session = gateway.open_session("five")
    client = client_for(server, "five")
    messages = [SYSTEM, {"role": "user", "content": "What is 2 + 3?"}]
    for k in range(5):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        messages += [echo(reply.choices[0].message), {"role": "user", "content": f"next {k}"}]
    (sample,) = session.to_samples(reward=1.0, stop_reason="terminated")
    assert session.metrics()["prefix_breaks"] == 0 and session.calls == 5
    # every token the engine sampled, in order, is in the sample with mask 1 and its logprob
    engine_tokens = [t for _, g in rec.calls for t in g.token_ids]
    engine_logprobs = [x for _, g in rec.calls for x in g.logprobs]
    assert sampled(sample) == engine_tokens and len(engine_tokens) > 0
    assert [x for x, m in zip(sample.logprobs_T, sample.loss_mask_T) if m] == engine_logprobs
    assert all(v == 0 for v, m in zip(sample.versions_T, sample.loss_mask_T) if m)
    # each request's input is the sample's prefix: the policy saw exactly these tokens
    for input_ids, gen in rec.calls:
        n = len(input_ids)
        assert list(sample.token_ids_T[:n]) == input_ids
        assert list(sample.token_ids_T[n : n + len(gen.token_ids)]) == list(gen.token_ids)
    first_prompt = gateway.chat.prompt_ids(
        [Message.from_dict(m) for m in messages[:2]], [])
    assert list(sample.token_ids_T[: sample.prompt_len]) == first_prompt
    assert len(sample.turn_ends) == 5 and sample.turn_ends[-1] == sample.num_tokens


async def test_canonical_replies_continue_exactly_and_match_a_full_render(
    engine, tokenizer, steer
):
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
    engine.logits_processors.append(steer(tokenizer, [call, "The answer is 5.", "Done."]))
    gateway = Gateway(engine, tokenizer, "qwen", sampling=SamplingParams(max_new_tokens=40))
    server = await serve_gateway(gateway)
    try:
        session = gateway.open_session("exact")
        client = client_for(server, "exact")
        messages = [SYSTEM, {"role": "user", "content": "What is 2 + 3?"}]
        first = await client.chat.completions.create(model="p", messages=messages, tools=TOOLS)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        (tc,) = choice.message.tool_calls
        assert tc.function.name == "calculator"
        assert json.loads(tc.function.arguments) == {"expression": "2 + 3"}
        messages += [echo(choice.message),
                     {"role": "tool", "tool_call_id": tc.id, "content": "5"}]
        second = await client.chat.completions.create(model="p", messages=messages, tools=TOOLS)
        assert second.choices[0].message.content == "The answer is 5."
        messages += [echo(second.choices[0].message), {"role": "user", "content": "Thanks"}]
        third = await client.chat.completions.create(model="p", messages=messages, tools=TOOLS)
        assert third.model_extra["palaestra"] == {"sample": 0, "continued": "exact"}
        metrics = session.metrics()
        assert metrics["exact_continuations"] == 2 and metrics["prefix_breaks"] == 0
        (sample,) = session.to_samples(reward=0.0, stop_reason="terminated")
        # the recorded ids are exactly the full render of the last request + the sampled reply
        full = gateway.chat.prompt_ids([Message.from_dict(m) for m in messages], TOOLS)
        assert list(sample.token_ids_T[: len(full)]) == full
        assert sample.num_tokens == len(full) + third.usage.completion_tokens
    finally:
        await server.close()


async def test_reformatted_reply_is_reconciled_not_a_break(engine, tokenizer, steer):
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
    engine.logits_processors.append(steer(tokenizer, [call, "It is 2."]))
    gateway = Gateway(engine, tokenizer, "qwen", sampling=SamplingParams(max_new_tokens=40))
    server = await serve_gateway(gateway)
    try:
        session = gateway.open_session("ws")
        client = client_for(server, "ws")
        messages = [{"role": "user", "content": "1+1?"}]
        first = await client.chat.completions.create(model="p", messages=messages, tools=TOOLS)
        (tc,) = first.choices[0].message.tool_calls
        # the agent re-serialises the arguments and pads the content: other ids on re-render
        edited = {"role": "assistant", "content": "  \n", "tool_calls": [
            {"id": tc.id, "type": "function",
             "function": {"name": "calculator", "arguments": '{ "expression" : "1+1" }'}}]}
        messages += [edited, {"role": "tool", "tool_call_id": tc.id, "content": "2"}]
        second = await client.chat.completions.create(model="p", messages=messages, tools=TOOLS)
        assert second.model_extra["palaestra"] == {"sample": 0, "continued": "reconciled"}
        (sample,) = session.to_samples(reward=0.0, stop_reason="terminated")
        # the sampled call tokens are kept as sampled, not replaced by the client's version
        n_first = first.usage.completion_tokens
        start = first.usage.prompt_tokens
        assert sum(sample.loss_mask_T[start : start + n_first]) == n_first
        assert session.metrics()["prefix_breaks"] == 0
    finally:
        await server.close()


async def test_edited_history_starts_a_second_sample(served):
    gateway, server, rec = served
    session = gateway.open_session("edit")
    client = client_for(server, "edit")
    messages = [SYSTEM, {"role": "user", "content": "Tell me a number."}]
    r1 = await client.chat.completions.create(model="p", messages=messages)
    messages += [echo(r1.choices[0].message), {"role": "user", "content": "Another."}]
    await client.chat.completions.create(model="p", messages=messages)
    # the agent rewrites its first question (e.g. a summarised or trimmed history)
    edited = [SYSTEM, {"role": "user", "content": "Tell me two numbers."}]
    r3 = await client.chat.completions.create(model="p", messages=edited)
    assert r3.model_extra["palaestra"] == {"sample": 1, "continued": "new"}
    assert session.metrics()["prefix_breaks"] == 1
    assert "message 1 (user) was edited" in session.break_reasons[0]
    # the new branch continues as its own sample
    edited += [echo(r3.choices[0].message), {"role": "user", "content": "More."}]
    r4 = await client.chat.completions.create(model="p", messages=edited)
    assert r4.model_extra["palaestra"]["sample"] == 1
    assert r4.model_extra["palaestra"]["continued"] != "new"
    samples = session.to_samples(reward=0.5, stop_reason="terminated")
    assert len(samples) == 2 and session.metrics()["prefix_breaks"] == 1
    # every sampled token of both samples is one the engine returned, each exactly once
    recorded = sorted(t for s in samples for t in sampled(s))
    assert recorded == sorted(t for _, g in rec.calls for t in g.token_ids)
    assert samples[1].token_ids_T[: samples[1].prompt_len] == tuple(rec.calls[2][0])


async def test_streaming_answers_sse_chunks(engine, tokenizer, steer):
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
    engine.logits_processors.append(steer(tokenizer, ["Let me compute.\n" + call]))
    gateway = Gateway(engine, tokenizer, "qwen", sampling=SamplingParams(max_new_tokens=60))
    server = await serve_gateway(gateway)
    try:
        gateway.open_session("sse")
        client = client_for(server, "sse")
        stream = await client.chat.completions.create(
            model="p", messages=[{"role": "user", "content": "6*7?"}], tools=TOOLS, stream=True,
            stream_options={"include_usage": True})
        content, calls, finish, usage = "", {}, None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for tc in choice.delta.tool_calls or ():
                    calls.setdefault(tc.index, tc)
                finish = choice.finish_reason or finish
        assert content == "Let me compute." and finish == "tool_calls"
        assert calls[0].function.name == "calculator"
        assert json.loads(calls[0].function.arguments) == {"expression": "6*7"}
        assert usage is not None and usage.completion_tokens > 0
        assert gateway.sessions["sse"].calls == 1
    finally:
        await server.close()


async def test_sessions_by_header_models_and_unknown_sessions(served):
    gateway, server, _ = served
    gateway.open_session("hdr")
    plain = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                               default_headers={"X-Palaestra-Session": "hdr"})
    models = await plain.models.list()
    assert [m.id for m in models.data] == ["policy"]
    reply = await plain.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert reply.usage.completion_tokens <= 3 and gateway.sessions["hdr"].calls == 1
    with pytest.raises(openai.NotFoundError, match="unknown or finished session"):
        await client_for(server, "nope").chat.completions.create(
            model="p", messages=[{"role": "user", "content": "hi"}])
    anonymous = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="no session"):
        await anonymous.chat.completions.create(
            model="p", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="not supported"):
        await plain.chat.completions.create(
            model="p", messages=[{"role": "user", "content": "hi"}], n=2)


async def test_call_and_context_limits(served):
    gateway, server, _ = served
    session = gateway.open_session("lim", max_calls=1)
    client = client_for(server, "lim")
    msgs = [{"role": "user", "content": "hi"}]
    await client.chat.completions.create(model="p", messages=msgs)
    with pytest.raises(openai.RateLimitError, match="budget of 1 calls"):
        await client.chat.completions.create(model="p", messages=msgs)
    assert session.stop_reason == "max_calls" and session.stopped.is_set()
    small = gateway.open_session("ctx", max_context=20)
    with pytest.raises(openai.BadRequestError, match="context limit"):
        await client_for(server, "ctx").chat.completions.create(
            model="p", messages=[{"role": "user", "content": "word " * 40}])
    assert small.stop_reason == "context"


async def test_an_aborted_generation_is_resumed_with_both_versions(engine, tokenizer, recording):
    rec = recording(engine, abort_first_after=3)
    gateway = Gateway(rec, tokenizer, "qwen",
                      sampling=SamplingParams(max_new_tokens=8, seed=3, ignore_eos=True))
    server = await serve_gateway(gateway)
    try:
        session = gateway.open_session("abort")

        original = rec.generate

        async def generate(input_ids, sampling, **kw):
            gen = await original(input_ids, sampling, **kw)
            if gen.finish_reason == "abort":
                engine.set_weight_version(1)  # the update that caused the abort
            return gen

        rec.generate = generate
        reply = await client_for(server, "abort").chat.completions.create(
            model="p", messages=[{"role": "user", "content": "hi"}])
        assert reply.usage.completion_tokens == 8
        (sample,) = session.to_samples(reward=0.0, stop_reason="terminated")
        versions = [v for v, m in zip(sample.versions_T, sample.loss_mask_T) if m]
        assert versions == [0, 0, 0, 1, 1, 1, 1, 1]
        assert session.counters["aborts"] == 1
        assert sampled(sample) == [t for _, g in rec.calls for t in g.token_ids]
    finally:
        await server.close()

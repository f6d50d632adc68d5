"""`palaestra serve` over real loopback HTTP: SGLang's native API (checked against the field tables
read off SGLang's io_struct), the SGLangClient against it, and the OpenAI API with the openai
client, tool calls included."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import torch

from palaestra.errors import EngineError
from palaestra.engines.serve import sglang_protocol as sp
from palaestra.engine import Engine, SamplingParams
from palaestra.engines.local.local import LocalEngine
from palaestra.engines.serve.serve import start_server
from palaestra.engines.clients.sglang_client import SGLangClient

from engine_testing import ForcedTokens, prompts

# SGLang fields checked (io_struct.py at sglang commit 001067fffe33427bee0ed2f007fb7551a1d76b44,
# http_server.py at 0025436eab0556737d615b36a4dd3e1e26e82f3d; sglang 0.5.x). The full tables are
# in palaestra.engines.serve.sglang_protocol; these are the ones this API relies on.
CHECKED_GENERATE_FIELDS = ("rid", "text", "input_ids", "sampling_params", "return_logprob",
                           "logprob_start_len", "top_logprobs_num", "stream", "session_id")
CHECKED_SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop",
                           "stop_token_ids", "ignore_eos", "logit_bias", "sampling_seed", "n")
CHECKED_META_INFO = ("id", "finish_reason", "prompt_tokens", "completion_tokens",
                     "cached_tokens", "weight_version", "output_token_logprobs", "e2e_latency")
CHECKED_TENSOR_UPDATE = ("serialized_named_tensors", "load_format", "flush_cache",
                         "abort_all_requests", "weight_version")


def check_generate_response(out: dict, return_logprob: bool) -> None:
    """A /generate answer has SGLang's shape (keys, types, finish_reason objects)."""
    assert set(out) <= sp.GENERATE_RESPONSE_KEYS and {"output_ids", "meta_info"} <= set(out)
    meta = out["meta_info"]
    assert set(meta) <= sp.GENERATE_META_INFO_KEYS, set(meta) - sp.GENERATE_META_INFO_KEYS
    for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                "weight_version"):
        assert key in meta
    assert isinstance(meta["weight_version"], str)  # server_args.weight_version is a str
    finish = meta["finish_reason"]
    assert finish["type"] in sp.FINISH_REASON_TYPES
    assert set(sp.FINISH_REASON_TYPES[finish["type"]]) <= set(finish)
    assert meta["completion_tokens"] == len(out["output_ids"])
    if return_logprob:
        pairs = meta["output_token_logprobs"]
        assert [p[1] for p in pairs] == out["output_ids"]
        assert all(len(p) == 3 and isinstance(p[0], float) and p[2] is None for p in pairs)


def test_checked_fields_are_in_the_tables() -> None:
    assert set(CHECKED_GENERATE_FIELDS) <= set(sp.GENERATE_REQ_INPUT)
    assert set(CHECKED_SAMPLING_FIELDS) <= set(sp.SAMPLING_PARAMS)
    assert set(CHECKED_META_INFO) <= sp.GENERATE_META_INFO_KEYS
    assert set(CHECKED_TENSOR_UPDATE) <= set(sp.UPDATE_WEIGHTS_FROM_TENSOR_REQ_INPUT)
    # what the client sends is SGLang's schema
    body = {"input_ids": [1], "sampling_params": SamplingParams(
        stop_token_ids=(3,), stop=("x",), seed=1, ignore_eos=True, logit_bias={5: 1.0}).to_sglang(),
        "return_logprob": True, "rid": "r"}
    sp.check_body(body, sp.GENERATE_REQ_INPUT, "GenerateReqInput")
    sp.check_body(body["sampling_params"], sp.SAMPLING_PARAMS, "SamplingParams")
    assert set(body["sampling_params"]) <= set(sp.SAMPLING_PARAMS)


@pytest.fixture
async def served(model_dir: str):
    engine = LocalEngine(model_dir)
    server = await start_server(engine)
    client = SGLangClient(server.url, retries=1, backoff_s=0.05)
    yield engine, server, client
    await client.close()
    await server.close()
    await engine.close()


async def post(url: str, body: object, method: str = "POST") -> tuple[int, object]:
    async with aiohttp.ClientSession() as s, s.request(method, url, json=body) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text) if text else None
        except ValueError:
            return r.status, text


async def test_client_over_http_equals_in_process(served, hf_model) -> None:
    engine, server, client = served
    assert isinstance(client, Engine)
    assert await client.health()
    params = SamplingParams(max_new_tokens=10, temperature=0)
    batch = prompts(6, seed=20)
    remote = await asyncio.gather(*(client.generate(p, params) for p in batch))
    for p, gen in zip(batch, remote):
        local = await engine.generate(p, params)
        assert gen.token_ids == local.token_ids and gen.finish_reason == local.finish_reason
        assert torch.allclose(torch.tensor(gen.logprobs), torch.tensor(local.logprobs), atol=1e-5)
        assert gen.prompt_tokens == len(p) and gen.meta["engine"] == server.url


async def test_generate_payloads_follow_sglang(served, tokenizer) -> None:
    _, server, _ = served
    status, out = await post(server.url + "/generate", {
        "input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 5, "temperature": 0},
        "return_logprob": True, "rid": "abc"})
    assert status == 200
    check_generate_response(out, True)
    assert out["meta_info"]["id"] == "abc"
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    # text input, batch of two with n=2: a list of 4 answers, rids expanded like SGLang
    status, outs = await post(server.url + "/generate", {
        "text": ["hello", "what is"], "rid": "b",
        "sampling_params": {"max_new_tokens": 3, "n": 2, "temperature": 0}})
    assert status == 200 and len(outs) == 4
    assert [o["meta_info"]["id"] for o in outs] == ["b_0", "b_1", "b_2", "b_3"]
    for o in outs:
        check_generate_response(o, False)
    assert outs[0]["output_ids"] == outs[2]["output_ids"]  # greedy copies of the same prompt
    # streaming: cumulative chunks, the last one finished, then [DONE]
    async with aiohttp.ClientSession() as s, s.post(server.url + "/generate", json={
            "input_ids": [5, 6, 7], "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}) as r:
        raw = (await r.text()).strip().split("\n\n")
    assert raw[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in raw[:-1]]
    assert [len(c["output_ids"]) for c in chunks[:-1]] == [1, 2, 3, 4]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    for c in chunks[:-1]:
        assert set(c["meta_info"]) <= sp.GENERATE_META_INFO_KEYS


async def test_bad_requests_get_sglang_errors(served) -> None:
    _, server, _ = served
    cases = [
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "many"}},
        {"input_ids": [1, 2], "text": "both"},
        {"input_ids": []},
        {"input_ids": [1, 2], "sampling_params": {"regex": "a+"}},
        {"input_ids": [1, 2], "image_data": "x.png"},
        {"input_ids": [1, 2], "logprob_start_len": 0, "return_logprob": True},
        {"input_ids": [1, 10**7]},
    ]
    for body in cases:
        status, out = await post(server.url + "/generate", body)
        assert status == 400, body
        assert set(out) == {"object", "message", "type", "param", "code"} and out["code"] == 400
    status, out = await post(server.url + "/update_weights_from_disk", {"load_format": "auto"})
    assert status == 400 and "model_path" in out["message"]


async def test_weight_updates_over_http(served, other_weights_dir: str) -> None:
    from safetensors.torch import load_file

    engine, server, client = served
    p = prompts(1, lo=20, hi=21, seed=21)[0]
    params = SamplingParams(max_new_tokens=8, temperature=0)
    before = await client.generate(p, params)
    await client.update_weights(load_file(f"{other_weights_dir}/model.safetensors"), version=3)
    after = await client.generate(p, params)
    assert engine.weight_version == 3 and after.weight_version == 3
    assert after.token_ids != before.token_ids
    for path in ("/model_info", "/get_model_info"):  # SGLang's current name and the older one
        status, info = await post(server.url + path, None, "GET")
        assert status == 200 and info["weight_version"] == "3"
        assert set(info) == sp.MODEL_INFO_KEYS
        assert info["model_type"] == "qwen3" and info["architectures"] == ["Qwen3ForCausalLM"]
    await client.update_weights(path=engine.model_path)  # from disk: version 4, old weights
    back = await client.generate(p, params)
    assert back.token_ids == before.token_ids and back.weight_version == 4
    # an SGLang MultiprocessingSerializer-style payload (a pickle) is refused, clearly
    import base64
    import pickle

    status, out = await post(server.url + "/update_weights_from_tensor", {
        "serialized_named_tensors": [base64.b64encode(pickle.dumps([("a", 1)])).decode()]})
    assert status == 400 and "safetensors" in out["message"]
    with pytest.raises(EngineError, match="could not be loaded"):
        await client.update_weights({"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)})
    assert engine.weight_version == 4


async def test_distributed_updates_are_validated_then_refused(served) -> None:
    _, server, _ = served
    status, out = await post(server.url + "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2,
        "group_name": "g", "backend": "nccl"})
    assert status == 400 and out["success"] is False and "NCCL" in out["message"]
    status, out = await post(server.url + "/init_weights_update_group", {"master_address": "x"})
    assert status == 400 and "master_port" in out["message"]
    status, out = await post(server.url + "/update_weights_from_distributed", {
        "names": ["a", "b"], "dtypes": ["bfloat16"], "shapes": [[1], [2]]})
    assert status == 400 and "same length" in out["message"]
    status, out = await post(server.url + "/update_weights_from_distributed", {
        "names": ["a"], "dtypes": ["bfloat16"], "shapes": [[1]]})
    assert status == 400 and out["success"] is False


async def test_control_endpoints(served) -> None:
    engine, server, client = served
    task = asyncio.create_task(client.generate([5, 6, 7], SamplingParams(
        max_new_tokens=2000, temperature=0, ignore_eos=True), request_id="slow"))
    while engine.stats["generated_tokens"] < 3:
        await asyncio.sleep(0.005)
    status, loads = await post(server.url + "/get_load", None, "GET")  # the router's load poll
    assert status == 200 and loads[0]["num_reqs"] == 1 and loads[0]["num_tokens"] >= 3 + 2
    status, out = await post(server.url + "/pause_generation", {"mode": "in_place"})
    assert status == 200 and out == {"message": "Generation paused successfully.", "status": "ok"}
    held = engine.stats["generated_tokens"]
    await asyncio.sleep(0.05)
    assert engine.stats["generated_tokens"] == held
    status, out = await post(server.url + "/continue_generation", {})
    assert status == 200 and out["status"] == "ok"
    await client.abort(["slow"])
    gen = await task
    assert gen.finish_reason == "abort" and len(gen.token_ids) >= 3
    status, text = await post(server.url + "/flush_cache", None)
    assert status == 200 and text.startswith("Cache flushed.")
    status, _ = await post(server.url + "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert status == 200 and engine.cache.slots == 0
    status, _ = await post(server.url + "/resume_memory_occupation", {"tags": ["kv_cache"]})
    assert status == 200
    assert (await client.generate([5, 6], SamplingParams(max_new_tokens=2))).token_ids
    for path in ("/health", "/health_generate", "/get_server_info", "/get_weight_version"):
        status, _ = await post(server.url + path, None, "GET")
        assert status == 200, path
    status, info = await post(server.url + "/server_info", None, "GET")
    assert status == 200 and set(info) >= sp.SERVER_INFO_KEYS
    status, loads = await post(server.url + "/get_load", None, "GET")
    assert status == 200 and len(loads) == 1 and set(loads[0]) == sp.LOAD_KEYS
    assert loads[0]["num_reqs"] == 0 and loads[0]["num_tokens"] == 0


async def test_openai_chat_with_a_tool_call(served, tokenizer) -> None:
    import openai

    engine, server, _ = served
    call = '{"name": "calculator", "arguments": {"expression": "12 * 7"}}'
    script = tokenizer.encode(f"Let me compute.\n<tool_call>\n{call}\n</tool_call>")
    script.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    engine.logits_processors.append(ForcedTokens(script))
    tools = [{"type": "function", "function": {
        "name": "calculator", "description": "evaluate arithmetic",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}}]
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
    try:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        messages = [{"role": "user", "content": "What is 12 * 7?"}]
        resp = await client.chat.completions.create(model="tiny", messages=messages, tools=tools,
                                                    temperature=0, max_tokens=64)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me compute."
        (tc,) = choice.message.tool_calls
        assert tc.type == "function" and tc.function.name == "calculator"
        assert json.loads(tc.function.arguments) == {"expression": "12 * 7"}
        rendered = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=True)
        assert resp.usage.prompt_tokens == len(tokenizer.encode(rendered))
        assert resp.usage.completion_tokens == len(script)
        # streaming: content deltas, then the call in one delta, then usage
        stream = await client.chat.completions.create(
            model="tiny", messages=messages, tools=tools, stream=True, max_tokens=64,
            stream_options={"include_usage": True})
        content, calls, finish, usage = "", [], None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                content += c.delta.content or ""
                calls += c.delta.tool_calls or []
                finish = c.finish_reason or finish
        assert content == "Let me compute." and finish == "tool_calls"
        assert [c.function.name for c in calls] == ["calculator"]
        assert usage is not None and usage.completion_tokens == len(script)
        # the tool result goes back in and the conversation continues as text
        engine.logits_processors[:] = [ForcedTokens(tokenizer.encode("It is 84.") + [script[-1]])]
        follow = messages + [choice.message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": tc.id, "content": "84"}]
        resp = await client.chat.completions.create(model="tiny", messages=follow, tools=tools)
        assert resp.choices[0].message.content == "It is 84."
        assert resp.choices[0].finish_reason == "stop" and not resp.choices[0].message.tool_calls
        assert resp.usage.prompt_tokens_details.cached_tokens > 0  # turn 1 was reused
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            await client.chat.completions.create(model="tiny", messages=messages, tools=tools,
                                                 tool_choice="required")
    finally:
        await client.close()


async def test_openai_engine_chat(served, tokenizer) -> None:
    from palaestra.engines.clients.openai_engine import OpenAIEngine
    from palaestra.types import Message

    engine, server, _ = served
    call = '{"name": "lookup", "arguments": {"q": "x"}}'
    script = tokenizer.encode(f"<tool_call>\n{call}\n</tool_call>") + [
        tokenizer.convert_tokens_to_ids("<|im_end|>")]
    engine.logits_processors.append(ForcedTokens(script))
    api = OpenAIEngine("tiny", base_url=server.url + "/v1", api_key="none")
    try:
        assert await api.health()
        tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
            "type": "object", "properties": {"q": {"type": "string"}}}}}]
        reply = await api.chat([Message(role="user", content="find x")], tools=tools,
                               temperature=0)
        assert isinstance(reply, Message) and reply.role == "assistant"
        assert [c.name for c in reply.tool_calls] == ["lookup"] and reply.content == ""
        assert json.loads(reply.tool_calls[0].arguments) == {"q": "x"}
    finally:
        await api.close()


async def test_client_asks_current_info_names_then_the_older_ones(served) -> None:
    """`SGLangClient` asks ``/model_info`` (current SGLang); a server from before the rename
    (only ``/get_model_info``, as SGLang 0.4 serves) is asked by the older name after its 404."""
    from aiohttp import web

    _, server, client = served
    assert (await client.get_model_info())["model_type"] == "qwen3"
    assert not client._legacy_info
    asked: list[str] = []

    async def old_info(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.json_response({"model_path": "m", "weight_version": "7"})

    app = web.Application()
    app.router.add_get("/get_model_info", old_info)
    app.router.add_get("/get_server_info", old_info)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    old = SGLangClient(f"http://127.0.0.1:{port}", retries=0)
    try:
        assert (await old.get_model_info())["weight_version"] == "7"
        assert old.weight_version == 7 and old._legacy_info
        await old.get_server_info()
        assert asked == ["/get_model_info", "/get_server_info"]  # the 404 is asked once
    finally:
        await old.close()
        await runner.cleanup()

"""`palaestra serve` under a careless or hostile client, over real loopback HTTP (issue 18).

Every case of the review: huge and negative ``n``, ``max_tokens: 0``, wrong JSON types, token ids
outside the vocabulary, huge bodies, missing keys, a weight group at a closed port, SIGTERM
under load with open streams, ``/v1/completions`` and unknown model names. Each answer is checked
for its status and for the error body of its route (OpenAI's on ``/v1/*``, SGLang's elsewhere).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from palaestra.engines.local.local import LocalEngine
from palaestra.engines.serve.serve import serve_process, start_server
from palaestra.engines.serve.serve_guard import ServeOptions, exposure_warning
from palaestra.engines.serve.serve_requests import ServeLimits

MSGS = [{"role": "user", "content": "hi"}]
OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}
SGLANG_ERROR_KEYS = {"object", "message", "type", "param", "code"}


async def call(url: str, body: object = None, *, method: str = "POST", key: str | None = None,
               data: bytes | None = None, timeout_s: float = 60.0) -> tuple[int, object]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    kw: dict = {"data": data, "headers": {**headers, "Content-Type": "application/json"}} \
        if data is not None else {"json": body, "headers": headers}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as s, s.request(method, url, **kw) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text) if text else None
        except ValueError:
            return r.status, text


def openai_error(out: object, param: str | None = None, code: str | None = None) -> dict:
    assert isinstance(out, dict) and set(out) == {"error"}, out
    err = out["error"]
    assert set(err) == OPENAI_ERROR_KEYS and isinstance(err["message"], str), err
    assert "Traceback" not in err["message"] and "IndexError" not in err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def sglang_error(out: object, status: int = 400) -> dict:
    assert isinstance(out, dict) and set(out) == SGLANG_ERROR_KEYS, out
    assert out["object"] == "error" and out["code"] == status
    assert "internal error" not in out["message"] and "IndexError" not in out["message"]
    return out


@pytest.fixture
async def serve(model_dir: str):
    """A factory of loopback servers over one engine (closed at the end)."""
    engine = LocalEngine(model_dir, max_running=8)
    servers = []

    async def make(**options):
        limits = options.pop("limits", ServeLimits(max_n=8))
        server = await start_server(engine, options=ServeOptions(limits=limits, **options))
        servers.append(server)
        return server

    yield make
    for server in servers:
        await server.close()
    await engine.close()


async def test_n_is_bounded_and_validated(serve) -> None:
    server = await serve()
    chat = server.url + "/v1/chat/completions"
    for n, code in ((1_000_000_000, "above_max_value"), (2000, "above_max_value"),
                    (9, "above_max_value"), (-1, "below_min_value"), (0, "below_min_value")):
        status, out = await call(chat, {"messages": MSGS, "n": n, "max_tokens": 2},
                                 timeout_s=20)
        assert status == 400, (n, out)
        openai_error(out, "n", code)
    for n in (1_000_000_000, -1, 0):
        status, out = await call(server.url + "/generate", {
            "input_ids": [5, 6], "sampling_params": {"n": n, "max_new_tokens": 2}}, timeout_s=20)
        assert status == 400, (n, out)
        assert "'n'" in sglang_error(out)["message"] or "sampling_params.n" in out["message"]
    # a batch whose prompts x n exceed --max-batch is refused before anything is expanded
    small = await serve(limits=ServeLimits(max_n=8, max_batch=10))
    status, out = await call(small.url + "/generate", {
        "input_ids": [[5, 6]] * 3, "sampling_params": {"n": 4, "max_new_tokens": 1}})
    assert status == 400 and "12 sequences" in sglang_error(out)["message"]
    status, out = await call(chat, {"messages": MSGS, "n": 8, "max_tokens": 2})
    assert status == 200 and [c["index"] for c in out["choices"]] == list(range(8))
    assert (await call(server.url + "/health", method="GET"))[0] == 200


async def test_max_tokens_zero_is_not_unset(serve) -> None:
    server = await serve()
    status, out = await call(server.url + "/v1/chat/completions",
                             {"messages": MSGS, "max_tokens": 0})
    assert status == 400
    openai_error(out, "max_tokens", "below_min_value")
    status, out = await call(server.url + "/v1/chat/completions",
                             {"messages": MSGS, "max_completion_tokens": 0})
    assert status == 400
    openai_error(out, "max_completion_tokens")
    status, out = await call(server.url + "/generate", {
        "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 0, "ignore_eos": True}})
    assert status == 200 and out["output_ids"] == [] and out["meta_info"]["completion_tokens"] == 0
    status, out = await call(server.url + "/v1/completions",
                             {"prompt": "hello", "max_tokens": 0, "echo": True})
    assert status == 200 and out["choices"][0]["text"] == "hello"
    assert out["usage"]["completion_tokens"] == 0
    # max_tokens beyond the context: OpenAI's context_length_exceeded, not a silent clamp
    status, out = await call(server.url + "/v1/chat/completions",
                             {"messages": MSGS, "max_tokens": 10**9})
    assert status == 400
    openai_error(out, "max_tokens")


@pytest.mark.parametrize(("field", "value"), [
    ("n", "abc"), ("temperature", "hot"), ("stop", 5), ("tools", "x"), ("logit_bias", {"a": 1}),
    ("seed", "x"), ("max_tokens", "5"), ("max_tokens", 2.7), ("top_p", 7), ("stream", "yes"),
    ("temperature", 3), ("logit_bias", {"5": 1000}), ("messages", "hi"), ("n", True),
])
async def test_openai_wrong_types_are_400(serve, field: str, value: object) -> None:
    server = await serve()
    body = {"messages": MSGS, "max_tokens": 2, field: value}
    status, out = await call(server.url + "/v1/chat/completions", body)
    assert status == 400, out
    assert openai_error(out)["param"].split("[")[0].split(".")[0] == field
    status, out = await call(server.url + "/v1/completions",
                             {"prompt": "x", "max_tokens": 2, field: value})
    if field not in ("tools", "messages"):  # not completion fields
        assert status == 400, out
        openai_error(out)


@pytest.mark.parametrize("params", [
    {"n": "abc"}, {"temperature": "hot"}, {"stop": 5}, {"logit_bias": {"a": 1}},
    {"sampling_seed": "x"}, {"stop_token_ids": ["x"]}, {"max_new_tokens": "5"},
    {"max_new_tokens": 2.7}, {"stop_token_ids": [10**6]}, {"logit_bias": {"100000": 1.0}},
    {"top_k": -5}, {"no_such_param": 1},
])
async def test_native_wrong_types_are_400(serve, params: dict) -> None:
    server = await serve()
    status, out = await call(server.url + "/generate",
                             {"input_ids": [5, 6], "sampling_params": params})
    assert status == 400, out
    sglang_error(out)


async def test_logit_bias_outside_the_vocabulary(serve) -> None:
    server = await serve()
    status, out = await call(server.url + "/v1/chat/completions",
                             {"messages": MSGS, "max_tokens": 2, "logit_bias": {"100000": 1}})
    assert status == 400
    err = openai_error(out, "logit_bias", "invalid_value")
    assert "vocabulary" in err["message"]
    status, out = await call(server.url + "/v1/chat/completions",
                             {"messages": MSGS, "max_tokens": 2, "logit_bias": {"5": 50}})
    assert status == 200


async def test_huge_bodies(serve) -> None:
    server = await serve()
    probes: list[float] = []
    stop = asyncio.Event()

    async def probe() -> None:
        async with aiohttp.ClientSession() as s:
            while not stop.is_set():
                t = time.perf_counter()
                async with s.get(server.url + "/health") as r:
                    assert r.status == 200
                probes.append(time.perf_counter() - t)
                await asyncio.sleep(0.02)

    prober = asyncio.create_task(probe())
    await asyncio.sleep(0.1)
    ten_mb = "hello world " * (10 * (1 << 20) // 12)
    status, out = await call(server.url + "/generate", {"text": ten_mb}, timeout_s=60)
    assert status == 400 and "context" in sglang_error(out)["message"]
    status, out = await call(server.url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": ten_mb}]}, timeout_s=60)
    assert status == 400
    openai_error(out, "messages", "context_length_exceeded")
    ids = json.dumps({"input_ids": [5] * 1_500_000}).encode()  # ~10 MB of token ids
    status, out = await call(server.url + "/generate", data=ids, timeout_s=60)
    assert status == 400 and "context" in sglang_error(out)["message"]
    stop.set()
    await prober
    # generous: the old server held /health for 7 s behind one such body
    assert probes and max(probes) < 2.0, max(probes)
    # the default limit is 32 MB, not 4 GiB: a 40 MB body is refused unread
    big = b'{"text": "' + b"a" * (40 << 20) + b'"}'
    status, out = await call(server.url + "/generate", data=big, timeout_s=60)
    assert status == 413 and "32 MB" in sglang_error(out, 413)["message"]
    small = await serve(max_body_mb=1)
    status, out = await call(small.url + "/v1/completions", data=b" " * (2 << 20) + b"{}")
    assert status == 413
    openai_error(out, None, "request_too_large")


async def test_api_keys(serve, other_weights_dir: str, model_dir: str) -> None:
    import openai

    server = await serve(api_key="user-key", admin_api_key="admin-key")
    gen = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
    status, out = await call(server.url + "/generate", gen)
    assert status == 401
    sglang_error(out, 401)
    assert (await call(server.url + "/generate", gen, key="wrong"))[0] == 401
    assert (await call(server.url + "/generate", gen, key="user-key"))[0] == 200
    assert (await call(server.url + "/generate", gen, key="admin-key"))[0] == 200
    assert (await call(server.url + "/health", method="GET"))[0] == 200  # probes stay open
    status, out = await call(server.url + "/v1/chat/completions", {"messages": MSGS})
    assert status == 401
    openai_error(out, None, "invalid_api_key")
    # the weight routes need the admin key: any local process could swap the weights before
    swap = {"model_path": other_weights_dir}
    status, out = await call(server.url + "/update_weights_from_disk", swap)
    assert status == 401
    status, out = await call(server.url + "/update_weights_from_disk", swap, key="user-key")
    assert status == 403 and "admin" in sglang_error(out, 403)["message"]
    for path in ("/flush_cache", "/abort_request", "/pause_generation",
                 "/init_weights_update_group", "/release_memory_occupation"):
        assert (await call(server.url + path, {}, key="user-key"))[0] == 403, path
    _, info = await call(server.url + "/get_model_info", method="GET", key="user-key")
    assert info["model_path"] == model_dir
    status, out = await call(server.url + "/update_weights_from_disk", swap, key="admin-key")
    assert status == 200 and out["success"]
    _, info = await call(server.url + "/get_model_info", method="GET", key="user-key")
    assert info["model_path"] == other_weights_dir  # names the weights now served
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="user-key", max_retries=0)
    try:
        resp = await client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2)
        assert resp.choices[0].finish_reason in ("length", "stop")
        bad = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()
        await bad.close()
    finally:
        await client.close()


def test_exposure_warning() -> None:
    assert exposure_warning("127.0.0.1", ServeOptions()) is None
    assert exposure_warning("::1", ServeOptions()) is None
    assert "--api-key" in exposure_warning("0.0.0.0", ServeOptions())
    only_user = exposure_warning("10.0.0.5", ServeOptions(api_key="k"))
    assert "--admin-api-key" in only_user and "swap the weights" in only_user
    assert exposure_warning("0.0.0.0", ServeOptions(api_key="k", admin_api_key="a")) is None


async def test_weight_group_at_a_closed_port_fails_fast(serve) -> None:
    from palaestra.engines.weights.weight_transfer import free_port

    server = await serve(weight_group_connect_timeout_s=1.0, weight_group_timeout_s=5.0)
    status, out = await call(server.url + "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
        "world_size": 2, "group_name": "g", "backend": "gloo"}, timeout_s=20)
    assert status == 400 and out["success"] is False
    assert "nothing accepts connections" in out["message"]
    status, out = await call(server.url + "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": 70000, "rank_offset": 0,
        "world_size": 2, "backend": "gloo"})
    assert status == 400 and "rank 0 is the trainer" in sglang_error(out)["message"]


async def test_v1_completions(serve, tokenizer) -> None:
    import openai

    server = await serve()
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    try:
        resp = await client.completions.create(model="tiny", prompt="hello there", max_tokens=4,
                                               temperature=0, logprobs=0)
        (choice,) = resp.choices
        assert resp.object == "text_completion" and resp.usage.completion_tokens <= 4
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset)
        assert lp.text_offset == sorted(lp.text_offset) and all(x <= 0 for x in lp.token_logprobs)
        ids = tokenizer.encode("hello there")
        same = await client.completions.create(model="tiny", prompt=ids, max_tokens=4,
                                               temperature=0)
        assert same.choices[0].text == choice.text  # token-id prompts equal text prompts
        multi = await client.completions.create(model="tiny", prompt=[ids, ids[:2]], n=2,
                                                max_tokens=2, temperature=0)
        assert [c.index for c in multi.choices] == [0, 1, 2, 3]
        assert multi.choices[0].text == multi.choices[1].text  # greedy copies of prompt 0
        text = ""
        async for chunk in await client.completions.create(
                model="tiny", prompt="hello there", max_tokens=4, temperature=0, stream=True):
            text += "".join(c.text for c in chunk.choices)
        assert text == choice.text
        with pytest.raises(openai.BadRequestError, match="top logprobs"):
            await client.completions.create(model="tiny", prompt="x", logprobs=3)
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await client.completions.create(model="gpt-3.5-turbo-instruct", prompt="x")
    finally:
        await client.close()


async def test_unknown_model_is_404(serve) -> None:
    server = await serve()
    status, out = await call(server.url + "/v1/chat/completions",
                             {"model": "gpt-4o", "messages": MSGS, "max_tokens": 2})
    assert status == 404
    openai_error(out, "model", "model_not_found")
    status, out = await call(server.url + "/v1/chat/completions",
                             {"model": "tiny", "messages": MSGS, "max_tokens": 2})
    assert status == 200 and out["model"] == "tiny"


async def test_drain_lets_short_requests_finish(serve) -> None:
    server = await serve()
    # Wait on the admission itself, not on ``inflight > 0``: a short request can be admitted and
    # finished between two polls, and a poll for it would then wait forever.
    admitted = asyncio.Event()
    track = server.state.track

    def track_and_note(delta: int) -> None:
        track(delta)
        if delta > 0:
            admitted.set()

    server.state.track = track_and_note  # type: ignore[method-assign]
    task = asyncio.create_task(call(server.url + "/generate", {
        "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}))
    await asyncio.wait_for(admitted.wait(), 60)
    assert await server.drain(grace_s=60)  # finished within the grace period
    status, out = await task
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length"
    with pytest.raises(aiohttp.ClientConnectionError):  # the port is closed
        await call(server.url + "/health", method="GET", timeout_s=5)


async def _read_sse(url: str, body: dict, first: asyncio.Event) -> list[str]:
    events: list[str] = []
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200
        buf = b""
        async for data in r.content.iter_any():
            buf += data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                events.append(event.decode())
                if len(events) >= 3:
                    first.set()
    return events


async def test_sigterm_under_load_ends_streams_properly(model_dir: str, tmp_path) -> None:
    proc = serve_process(model_dir, device="cpu", log_path=tmp_path / "serve.log", extra=(
        "--threads", "1", "--max-running", "8", "--shutdown-grace-s", "0"))
    try:
        await proc.wait_ready(120)
        long = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0}
        firsts = [asyncio.Event() for _ in range(3)]
        streams = [
            asyncio.create_task(_read_sse(proc.url + "/generate", {
                "input_ids": [5, 6, 7], "stream": True,
                "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}, firsts[0])),
            asyncio.create_task(_read_sse(proc.url + "/v1/chat/completions", {
                "messages": MSGS, "stream": True, **long}, firsts[1])),
            asyncio.create_task(_read_sse(proc.url + "/v1/completions", {
                "prompt": "hello", "stream": True, **long}, firsts[2])),
        ]
        plain = [
            asyncio.create_task(call(proc.url + "/generate", {
                "input_ids": [8, 9], "sampling_params": {"max_new_tokens": 1500,
                                                         "ignore_eos": True}})),
            asyncio.create_task(call(proc.url + "/v1/chat/completions",
                                     {"messages": MSGS, **long})),
        ]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 60)
        sent = time.monotonic()
        os.killpg(proc.proc.pid, signal.SIGTERM)
        results = await asyncio.wait_for(asyncio.gather(*streams), 30)
        for events in results:
            assert events[-1] == "data: [DONE]", events[-3:]
            error = json.loads(events[-2][len("data: "):])
            assert "shutting down" in error["error"]["message"], error
        status, out = await asyncio.wait_for(plain[0], 30)
        assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
        assert "shutting down" in out["meta_info"]["finish_reason"]["message"]
        status, out = await asyncio.wait_for(plain[1], 30)
        assert status == 503
        openai_error(out, None, "server_shutting_down")
        rc = await asyncio.to_thread(proc.proc.wait, 30)
        assert rc == 0 and time.monotonic() - sent < 30, proc.log_tail()
    finally:
        proc.stop()

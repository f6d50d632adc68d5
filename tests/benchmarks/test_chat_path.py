"""The message-level path (``--engine openai``) over real loopback HTTP: the openai client against a
small scripted OpenAI-compatible server, with tool calls, throttling, server errors and refusals.

The server is scripted (it reads the question, calls the calculator tool, then copies the tool's
result into ``<answer>``), so the harness's numbers are known exactly; everything between the
harness and the server (openai client, HTTP, retries, the chat loop, the env) is the real thing.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from aiohttp import web

from palaestra.benchmarks.openai_chat import OpenAIChat
from palaestra.benchmarks.policies import ChatPolicy
from palaestra.benchmarks.runner import EvalSettings, evaluate
from palaestra.errors import ConfigError, EngineError


class ScriptedOpenAI:
    """``/v1/models`` and ``/v1/chat/completions`` answering arithmetic with the calculator tool."""

    def __init__(self) -> None:
        self.fail_next: list[int] = []  # statuses to answer the next requests with
        self.chat_requests = 0
        self.key = "sk-test"
        self.bodies: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    def _authorized(self, request: web.Request) -> bool:
        return request.headers.get("Authorization") == f"Bearer {self.key}"

    async def models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        return web.json_response(
            {"object": "list", "data": [{"id": "scripted", "object": "model", "created": 0, "owned_by": "t"}]}
        )

    async def chat(self, request: web.Request) -> web.Response:
        self.chat_requests += 1
        body = await request.json()
        self.bodies.append(body)
        if self.fail_next:
            status = self.fail_next.pop(0)
            headers = {"Retry-After": "0"} if status == 429 else {}
            return web.json_response({"error": {"message": f"scripted {status}"}}, status=status, headers=headers)
        messages = body["messages"]
        last = messages[-1]
        if "Question:" in messages[0]["content"]:  # the Search-R1 protocol (tags in the text)
            return self._search_r1(body)
        if last["role"] == "tool":
            message = {"role": "assistant", "content": f"<answer>{last['content']}</answer>"}
            finish = "stop"
        else:
            expression = re.search(r"What is (.*)\?", last["content"]).group(1)
            call = {
                "id": f"call_{self.chat_requests}",
                "type": "function",
                "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
            }
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
            finish = "tool_calls"
        return web.json_response(
            {
                "id": f"chatcmpl-{self.chat_requests}",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": 50, "completion_tokens": 7, "total_tokens": 57},
            }
        )


    golds: dict[str, str] = {}

    def _search_r1(self, body: dict[str, Any]) -> web.Response:
        messages = body["messages"]
        question = messages[0]["content"].split("Question:")[1].strip()
        if len(messages) == 1:  # search first; a real API cuts the text at the stop string
            text = f"<think>I need facts.</think><search>{question}</search><information>made up"
            stop = (body.get("stop") or [None])[0]
            if stop and stop in text:
                text = text[: text.index(stop)]
        else:
            text = f"<answer>{self.golds[question]}</answer>"
        return web.json_response({
            "id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        })


@pytest.fixture
async def server():
    scripted = ScriptedOpenAI()
    runner = web.AppRunner(scripted.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    scripted.url = f"http://127.0.0.1:{port}/v1"
    yield scripted
    await runner.cleanup()


def _policy(server: ScriptedOpenAI, **kwargs: Any) -> ChatPolicy:
    chat = OpenAIChat(server.url, "scripted", server.key, retry_base_s=0.01, **kwargs)
    return ChatPolicy(chat, model="scripted")


async def test_tool_calling_episodes_over_http(server, tmp_path):
    policy = _policy(server)
    summary = await evaluate(["calculator"], policy, EvalSettings(limit=5, temperature=0.0),
                             out_dir=tmp_path / "run", progress=False, report=False)
    await policy.close()
    s = summary["calculator"]
    assert s["pass@1"] == 1.0 and s["tasks"] == 5
    assert s["mean_turns"] == 2.0
    record = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])
    roles = [m["role"] for m in record["trajectory"]["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    call = record["trajectory"]["messages"][2]["tool_calls"][0]
    assert call["function"]["name"] == "calculator"
    assert record["tool_calls"] == 1
    assert record["completion_tokens"] == 14 and record["prompt_tokens"] == 100  # API usage
    assert record["trajectory"]["samples"] == []  # no token ids from an API
    # the tools went to the API, the tool result came back with its call id
    assert server.bodies[0]["tools"][0]["function"]["name"] == "calculator"
    answers = [b["messages"] for b in server.bodies if b["messages"][-1]["role"] == "tool"]
    assert len(answers) == 5
    for messages in answers:
        assert messages[-1]["tool_call_id"] == messages[-2]["tool_calls"][0]["id"]


async def test_throttling_and_server_errors_are_retried(server):
    server.fail_next = [429, 503, 429]
    policy = _policy(server, retries=3)
    summary = await evaluate(["calculator"], policy, EvalSettings(limit=1, concurrency=1), progress=False)
    await policy.close()
    assert summary["calculator"]["pass@1"] == 1.0
    assert server.chat_requests == 2 + 3  # two turns + three refused attempts


async def test_a_refused_request_is_the_samples_failure_not_a_retry(server, tmp_path):
    server.fail_next = [400]
    policy = _policy(server, retries=3)
    summary = await evaluate(["calculator"], policy, EvalSettings(limit=1, concurrency=1),
                             out_dir=tmp_path / "run", progress=False, report=False)
    await policy.close()
    assert server.chat_requests == 1
    s = summary["calculator"]
    assert s["pass@1"] == 0.0 and s["errors"] == 1 and s["stop_reasons"] == {"error": 1}


async def test_persistent_server_errors_stop_the_run_and_are_not_stored(server, tmp_path):
    server.fail_next = [503] * 100
    policy = _policy(server, retries=1)
    with pytest.raises(EngineError, match="rerun"):
        await evaluate(["calculator"], policy,
                       EvalSettings(limit=10, concurrency=1, max_engine_failures=2),
                       out_dir=tmp_path / "run", progress=False, report=False)
    await policy.close()
    assert (tmp_path / "run" / "samples.jsonl").read_text() == ""


async def test_bad_key_unknown_model_and_unreachable_server_fail_before_work(server):
    wrong_key = ChatPolicy(OpenAIChat(server.url, "scripted", "sk-wrong"), model="scripted")
    with pytest.raises(EngineError, match="API key"):
        await evaluate(["calculator"], wrong_key, EvalSettings(limit=1), progress=False)
    unknown = ChatPolicy(OpenAIChat(server.url, "gpt-nope", server.key), model="gpt-nope")
    with pytest.raises(ConfigError, match="scripted"):
        await evaluate(["calculator"], unknown, EvalSettings(limit=1), progress=False)
    assert server.chat_requests == 0
    closed = ChatPolicy(OpenAIChat("http://127.0.0.1:9/v1", "scripted", "k"), model="scripted")
    with pytest.raises(EngineError, match="cannot reach"):
        await evaluate(["calculator"], closed, EvalSettings(limit=1), progress=False)


def test_cli_refuses_a_missing_api_key_before_any_work(tmp_path, monkeypatch, capsys):
    from palaestra.cli import main

    monkeypatch.delenv("MY_EVAL_KEY", raising=False)
    out = tmp_path / "run"
    code = main(["eval", "--benchmark", "calculator", "--engine", "openai", "--model", "m",
                 "--base-url", "https://api.example.com/v1", "--api-key-env", "MY_EVAL_KEY",
                 "--out", str(out)])
    assert code == 2
    assert "MY_EVAL_KEY" in capsys.readouterr().err
    assert not out.exists()


def test_cli_reports_an_unreachable_endpoint(tmp_path, capsys):
    from palaestra.cli import main

    out = tmp_path / "run"
    code = main(["eval", "--benchmark", "calculator", "--engine", "openai", "--model", "m",
                 "--base-url", "http://127.0.0.1:9/v1", "--out", str(out), "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert "cannot reach http://127.0.0.1:9/v1" in err
    assert not (out / "samples.jsonl").exists()


def test_cli_sglang_engine_checks_the_server_first(capsys):
    from palaestra.cli import main

    code = main(["eval", "--benchmark", "gsm8k", "--engine", "sglang", "--model", "http://127.0.0.1:9"])
    assert code == 2
    assert "cannot reach http://127.0.0.1:9/get_model_info" in capsys.readouterr().err


async def test_search_r1_over_a_chat_api_stops_at_the_search_tag(server, tmp_path):
    from palaestra.benchmarks import get_benchmark, load_tasks
    from palaestra.envs.search.env import golden_answers, question_of

    rows = [row for _, row, _ in load_tasks(get_benchmark("hotpotqa"), limit=2)]
    server.golds = {question_of(r): golden_answers(r)[0] for r in rows}
    policy = _policy(server)
    summary = await evaluate(["hotpotqa"], policy, EvalSettings(limit=2), out_dir=tmp_path / "run",
                             progress=False, report=False)
    await policy.close()
    assert summary["hotpotqa"]["pass@1"] == 1.0
    assert all(b["stop"] == ["</search>"] for b in server.bodies)
    record = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])
    first, info = record["trajectory"]["messages"][1:3]
    assert first["content"].endswith("</search>") and "made up" not in first["content"]
    assert info["role"] == "user" and info["content"].startswith("<information>Doc 1(Title:")

"""``palaestra gateway`` tried as a careless client and a hostile one would: a real ``palaestra
serve`` (micro model, context 256) and real ``palaestra gateway`` processes on loopback.

Context taken from the engine, over-long prompts answered ``context_length_exceeded`` with the
episode truncated, every problem of a post reported at once with strict types, size caps,
``/health`` that follows the engine, Bearer keys (SGLang's rule), strict session/finish/chat
fields. Each test failed on the gateway before issue 18's hardening.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

ENGINE_CONTEXT = 256
KEY, ADMIN = "agent-key-1", "admin-key-2"
GOOD = {"token_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1],
        "logprobs": [0.0, 0.0, -0.5, -1.25], "reward": 1.0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(url: str, method: str, path: str, body: Any = None, key: str | None = KEY,
         raw: bytes | None = None, timeout: float = 60) -> tuple[int, Any]:
    """One HTTP request; ``(status, decoded JSON body or text)``."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            status, payload = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, payload = exc.code, exc.read()
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload.decode(errors="replace")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PALAESTRA_") or
           k == "PALAESTRA_CACHE_DIR"}
    return {**env, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


class Proc:
    """A ``python -m palaestra ...`` process on a loopback port, its output in a file."""

    def __init__(self, args: list[str], port: int, log: str) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log
        self.log = open(log, "wb")  # noqa: SIM115 - open for the process's lifetime
        self.proc = subprocess.Popen([sys.executable, "-m", "palaestra", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=_env())

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_http(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"exited early:\n{self.output()}"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return
            except urllib.error.HTTPError:
                return  # it answers (a 503 is an answer)
            except OSError:
                time.sleep(0.25)
        raise AssertionError(f"{self.url} did not answer within {timeout_s} s:\n{self.output()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def engine_url(model_dir, tmp_path_factory) -> Iterator[str]:
    """A real ``palaestra serve`` of the micro model with a 256-token context."""
    port = _free_port()
    log = str(tmp_path_factory.mktemp("serve") / "serve.log")
    proc = Proc(["serve", "--model", model_dir, "--port", str(port), "--device", "cpu",
                 "--threads", "1", "--max-model-len", str(ENGINE_CONTEXT)], port, log)
    try:
        proc.wait_http()
        yield proc.url
    finally:
        proc.stop()


def gateway_args(engine: str, model_dir: str, port: int, *extra: str) -> list[str]:
    return ["gateway", "--engine", engine, "--tokenizer", model_dir, "--port", str(port),
            "--max-tokens", "4", "--temperature", "0", *extra]


@pytest.fixture(scope="module")
def gw(engine_url, model_dir, tmp_path_factory) -> Iterator[str]:
    """``palaestra gateway`` in front of it, with no --max-context, an API and an admin key."""
    port = _free_port()
    log = str(tmp_path_factory.mktemp("gateway") / "gateway.log")
    proc = Proc(gateway_args(engine_url, model_dir, port, "--api-key", KEY,
                             "--admin-api-key", ADMIN), port, log)
    try:
        proc.wait_http()
        yield proc.url
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def dead_gw(model_dir, tmp_path_factory) -> Iterator[str]:
    """A gateway whose engine is not running (a port nobody listens on), 1 MiB body limit."""
    port = _free_port()
    log = str(tmp_path_factory.mktemp("dead") / "gateway.log")
    proc = Proc(gateway_args(f"http://127.0.0.1:{_free_port()}", model_dir, port,
                             "--max-context", "128", "--max-body-mb", "1"), port, log)
    try:
        proc.wait_http()
        yield proc.url
    finally:
        proc.stop()


def long_prompt(words: int = 300) -> list[dict[str, str]]:
    return [{"role": "user", "content": " ".join(["answer"] * words)}]


def open_session(gw: str, sid: str) -> None:
    status, body = call(gw, "POST", "/sessions", {"session_id": sid})
    assert status == 200, body


# ------------------------------------------------------------------ context from the engine
def test_the_context_comes_from_the_engine(gw):
    status, models = call(gw, "GET", "/v1/models")
    assert status == 200 and models["data"][0]["max_model_len"] == ENGINE_CONTEXT


def test_an_over_long_prompt_is_context_length_exceeded_and_truncates_the_episode(gw):
    open_session(gw, "long")
    status, reply = call(gw, "POST", "/sessions/long/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, reply
    messages = [{"role": "user", "content": "hi"}, reply["choices"][0]["message"],
                *long_prompt()]
    status, refused = call(gw, "POST", "/sessions/long/v1/chat/completions",
                           {"messages": messages})
    assert status == 400 and refused["error"]["code"] == "context_length_exceeded", refused
    assert f"limit is {ENGINE_CONTEXT}" in refused["error"]["message"]
    status, summary = call(gw, "GET", "/sessions/long")
    assert summary["stop_reason"] == "context"
    status, receipt = call(gw, "POST", "/sessions/long/finish", {"reward": 0.0, "group_id": "L"})
    assert status == 200 and receipt["stop_reason"] == "truncated", receipt
    status, taken = call(gw, "POST", "/trajectories/take", {}, key=ADMIN)
    (group,) = [g for g in taken["groups"] if g["group_id"] == "L"]
    assert group["trajectories"][0]["stop_reason"] == "truncated"


def test_a_first_prompt_over_the_context_is_refused_before_the_engine(gw):
    open_session(gw, "first-long")
    status, refused = call(gw, "POST", "/sessions/first-long/v1/chat/completions",
                           {"messages": long_prompt()})
    assert status == 400 and refused["error"]["code"] == "context_length_exceeded"
    assert "engine" not in refused["error"]["message"]  # the gateway knew, it did not ask


def test_a_max_context_above_the_engines_is_refused_at_start(engine_url, model_dir):
    out = subprocess.run(
        [sys.executable, "-m", "palaestra",
         *gateway_args(engine_url, model_dir, _free_port(), "--max-context", "4096")],
        check=False, capture_output=True, text=True, timeout=120, env=_env())
    assert out.returncode != 0
    assert f"exceeds the context of {engine_url} ({ENGINE_CONTEXT} tokens)" in out.stderr


async def test_an_engine_refusal_for_length_is_context_length_exceeded(engine_url, tokenizer):
    """A gateway told a larger context than the engine's (an engine restarted smaller): the
    engine's 400 becomes ``context_length_exceeded`` and a truncated episode, not a 502."""
    from palaestra.engines.clients.router import Router
    from palaestra.engines.clients.sglang_client import SGLangClient
    from palaestra.rollout.gateway.gateway import Gateway
    from palaestra.rollout.gateway.engine_info import engine_context
    from palaestra.rollout.gateway.session import GatewayError

    router = Router([SGLangClient(engine_url), SGLangClient(engine_url)], health_interval_s=0)
    try:
        assert await engine_context(router) == ENGINE_CONTEXT
        gateway = Gateway(router, tokenizer, max_context=4096)
        session = gateway.open_session("s")
        with pytest.raises(GatewayError) as refused:
            await gateway.complete(session, {"messages": long_prompt()})
        assert (refused.value.status, refused.value.code) == (400, "context_length_exceeded")
        assert session.stop_reason == "context"
    finally:
        await router.close()


# ------------------------------------------------------------------ /trajectories
def test_every_problem_of_a_post_is_reported_at_once(gw):
    bad = [{**GOOD, "reward": "x"}, {**GOOD, "loss_mask": [0, 2, 1, 1]},
           {**GOOD, "logprobs": [0.0, 0.0, 0.5, -1.0]}]
    status, body = call(gw, "POST", "/trajectories", {"group_id": "many", "trajectories": bad})
    assert status == 422
    problems = body["error"]["problems"]
    assert len(problems) == 3, problems
    assert [p.split(".")[0] for p in problems] == [
        "trajectories[0]", "trajectories[1]", "trajectories[2]"]
    assert "3 problems" in body["error"]["message"]


def test_ids_are_not_coerced(gw):
    status, body = call(gw, "POST", "/trajectories",
                        {"group_id": 17, "trajectories": [GOOD]})
    assert status == 422 and "group_id must be a string, got 17 (an integer)" in \
        body["error"]["message"]
    status, body = call(gw, "POST", "/trajectories",
                        {"group_id": "g", "trajectories": [{**GOOD, "task_id": 5}]})
    assert status == 422 and "task_id must be a string" in body["error"]["message"]


def test_a_sample_longer_than_the_context_is_refused(gw):
    n = ENGINE_CONTEXT + 1
    sample = {"token_ids": [5] * n, "loss_mask": [0] + [1] * (n - 1),
              "logprobs": [0.0] + [-0.1] * (n - 1), "reward": 1.0}
    status, body = call(gw, "POST", "/trajectories", {"group_id": "big", "trajectories": [sample]})
    assert status == 422
    assert f"{n} tokens; this buffer takes at most {ENGINE_CONTEXT}" in body["error"]["message"]


def test_huge_metadata_is_refused(gw):
    post = {"group_id": "meta", "trajectories": [{**GOOD, "metadata": {"blob": "x" * 100_000}}]}
    status, body = call(gw, "POST", "/trajectories", post)
    assert status == 422 and "metadata is 100011 bytes" in body["error"]["message"]


def test_a_group_cannot_grow_past_the_cap(gw):
    status, body = call(gw, "POST", "/trajectories",
                        {"group_id": "crowd", "trajectories": [GOOD] * 1025})
    assert status == 422 and "1025 trajectories" in body["error"]["message"]
    status, body = call(gw, "POST", "/trajectories",
                        {"group_id": "crowd", "group_size": 20_000, "trajectories": [GOOD]})
    assert status == 422 and "group_size must be in [1, 1024]" in body["error"]["message"]


def test_a_body_over_the_limit_is_a_413(dead_gw):
    status, body = call(dead_gw, "POST", "/trajectories", raw=b"[" + b"1," * (600 << 10) + b"1]")
    assert status == 413 and body["error"]["code"] == "body_too_large"


# ------------------------------------------------------------------ health
def test_health_follows_the_engine(gw, dead_gw):
    status, body = call(gw, "GET", "/health", key=None)
    assert status == 200 and body["ok"] is True and body["engines"][0]["healthy"] is True
    status, body = call(dead_gw, "GET", "/health", key=None)
    assert status == 503 and body["ok"] is False
    assert body["engines"][0]["healthy"] is False


# ------------------------------------------------------------------ strict sessions and finish
def test_session_options_are_checked_strictly_all_at_once(gw):
    status, body = call(gw, "POST", "/sessions", {"max_calls": "x"})
    assert status == 400 and "TypeError" not in body["error"]["message"]
    assert "max_calls must be an integer, got 'x' (a string)" in body["error"]["message"]
    status, body = call(gw, "POST", "/sessions",
                        {"max_calls": True, "call_timeout_s": -1, "metadata": [1], "bogus": 1,
                         "session_id": "../x"})
    assert status == 400 and len(body["error"]["problems"]) == 5, body


def test_finish_fields_are_strict(gw):
    open_session(gw, "fin")
    status, _ = call(gw, "POST", "/sessions/fin/v1/chat/completions",
                     {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200
    status, body = call(gw, "POST", "/sessions/fin/finish", {"reward": "1", "group_id": 17})
    assert status == 400 and len(body["error"]["problems"]) == 2, body
    status, body = call(gw, "GET", "/sessions/fin")
    assert status == 200  # a refused finish leaves the session open


def test_take_and_claim_bodies_are_strict(gw):
    status, body = call(gw, "POST", "/trajectories/take", {"max_groups": "x"}, key=ADMIN)
    assert status == 400 and "ValueError" not in body["error"]["message"]
    status, body = call(gw, "POST", "/trajectories/claim", {"group_id": 3}, key=ADMIN)
    assert status == 400 and "group_id must be a string" in body["error"]["message"]


def test_chat_fields_are_strict(gw):
    open_session(gw, "chat")
    url = "/sessions/chat/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    for bad in ({"max_tokens": 0}, {"max_tokens": "5"}, {"max_tokens": True},
                {"stream": "no"}, {"logprobs": "no"}, {"stop": 5}, {"n": 2},
                {"temperature": "hot"}):
        status, body = call(gw, "POST", url, {"messages": msgs, **bad})
        assert status == 400, (bad, body)
        assert "Error:" not in body["error"]["message"], body  # no Python exception text
    status, body = call(gw, "POST", url, {"messages": msgs, "max_tokens": 0, "stream": "no",
                                          "n": 3})
    assert status == 400 and len(body["error"]["problems"]) == 3


# ------------------------------------------------------------------ keys
def test_routes_need_the_bearer_key(gw):
    assert call(gw, "GET", "/v1/models", key=None)[0] == 401
    assert call(gw, "GET", "/v1/models", key="wrong")[0] == 401
    status, body = call(gw, "POST", "/sessions", {}, key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert call(gw, "POST", "/trajectories", {"group_id": "k", "trajectories": [GOOD]},
                key=None)[0] == 401
    assert call(gw, "GET", "/v1/models", key=ADMIN)[0] == 401  # SGLang: the admin key is not
    assert call(gw, "GET", "/v1/models", key=KEY)[0] == 200    # the API key


def test_handing_groups_to_trainers_needs_the_admin_key(gw):
    assert call(gw, "POST", "/trajectories/take", {}, key=None)[0] == 401
    assert call(gw, "POST", "/trajectories/take", {}, key=KEY)[0] == 401
    assert call(gw, "POST", "/trajectories/claim", {"group_id": "none"}, key=KEY)[0] == 401
    assert call(gw, "POST", "/trajectories/take", {}, key=ADMIN)[0] == 200


def test_keys_follow_sglangs_rule_and_an_open_public_bind_warns():
    from palaestra.rollout.gateway.auth import GatewayKeys

    both = GatewayKeys(KEY, ADMIN)
    assert both.allows("/health", None)
    assert both.allows("/v1/models", f"Bearer {KEY}") and not both.allows("/v1/models", KEY)
    assert not both.allows("/trajectories/take", f"Bearer {KEY}")
    assert GatewayKeys(KEY).allows("/trajectories/take", f"bearer {KEY}")  # falls back to it
    assert GatewayKeys(None, ADMIN).allows("/sessions", None)
    assert not GatewayKeys(None, ADMIN).allows("/trajectories/claim", None)
    assert "without --api-key" in GatewayKeys().warning("0.0.0.0")
    assert GatewayKeys().warning("127.0.0.1") is None and GatewayKeys(KEY).warning("::") is None

"""MCP servers as envs, against real server processes: the shipped notes server over stdio (in the
sandbox) and streamable HTTP, a full episode through the rollout path, tool errors, a crashing
and a hanging server, the sandbox's walls around a server, and a short GRPO run."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from palaestra.envs import make
from palaestra.envs.ecosystem.mcp_env import notes_server_path
from palaestra.types import Message, StopReason, ToolCall

os.environ.setdefault("OMP_NUM_THREADS", "1")
SERVER = str(notes_server_path())
_NOTE = re.compile(r"under the key '([^']+)' the text '([^']+)'")


def _call(name: str, i: int = 0, **arguments: object) -> ToolCall:
    return ToolCall(name, json.dumps(arguments), id=f"c{i}")


def _act(*calls: ToolCall) -> Message:
    return Message("assistant", "", tool_calls=calls)


def _server_processes(marker: str) -> list[int]:
    """Pids whose command line carries ``marker`` (to see a server outlive its env)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline:
                pids.append(int(entry))
    return pids


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    import torch

    from palaestra.tiny_model import build_model

    torch.set_num_threads(1)
    return str(build_model(tmp_path_factory.mktemp("mcp-model"), "micro"))


class NotesPolicy:
    """Scripted "model": saves the notes the prompt asks for, then answers (count or done)."""

    def __init__(self, tokenizer_dir: str) -> None:
        from palaestra.agents import load_tokenizer

        self.tok = load_tokenizer(tokenizer_dir)

    def __call__(self, input_ids, rng):
        text = self.tok.decode(list(input_ids), skip_special_tokens=False)
        notes = dict(_NOTE.findall(text))
        if "<tool_response>" not in text:
            reply = "".join(
                "<tool_call>\n" + json.dumps({"name": "put_note", "arguments": {"key": k, "text": t}})
                + "\n</tool_call>" for k, t in notes.items()
            )
        elif "how many" in text:
            reply = f"<answer>{len(notes)}</answer>"
        else:
            reply = "<answer>done</answer>"
        return [*self.tok.encode(reply, add_special_tokens=False),
                self.tok.convert_tokens_to_ids("<|im_end|>")]


async def test_notes_episode_through_the_rollout_path(tokenizer_dir):
    from palaestra.agents import make_agent
    from palaestra.rollout.play import run_episode
    from palaestra.engine import SamplingParams
    from palaestra.engines.clients.scripted import ScriptedEngine

    env = make("palaestra/MCPNotes-v0")
    agent = make_agent(tokenizer_dir, "qwen", max_context=2048)
    engine = ScriptedEngine(NotesPolicy(tokenizer_dir))
    task = {"id": "two", "prompt": "Using the notes tools, save under the key 'todo' the text "
            "'fix bike'; under the key 'books' the text 'dune'. Then tell me how many notes the "
            "store holds, as <answer>N</answer>.", "notes": {"todo": "fix bike", "books": "dune"},
            "ask_count": True}
    traj = await run_episode(env, agent, engine, SamplingParams(max_new_tokens=128), task=task)
    assert traj.error is None and traj.stop_reason is StopReason.TERMINATED, traj
    assert traj.reward == 1.0 and traj.metrics["tool_calls"] == 2
    tool_messages = [m for t in traj.turns for m in t.observation if m.role == "tool"]
    assert [m.content for m in tool_messages] == ["saved 'todo'", "saved 'books'"]
    # the tools reached the model as OpenAI schemas rendered into the prompt
    prompt = agent.tokenizer.decode(list(traj.samples[0].token_ids_T[:traj.samples[0].prompt_len]))
    assert "put_note" in prompt and "list_notes" in prompt
    # the reward was read off the server's state: a wrong text scores less
    wrong = dict(task, notes={"todo": "fix car", "books": "dune"})
    traj = await run_episode(env, agent, engine, SamplingParams(max_new_tokens=128), task=wrong)
    assert traj.reward == pytest.approx(0.75)  # 1 of 2 notes as asked, the count right
    env.close()


def test_tool_errors_state_per_episode_and_close():
    marker = f"marker-{uuid.uuid4().hex[:8]}"
    env = make("palaestra/MCP-v0", command=["python", SERVER, "--hang-on", marker])
    obs, info = env.reset(seed=0)  # free-form: default prompt, no reward
    assert obs[-1].role == "user" and {t["function"]["name"] for t in info["tools"]} == {
        "put_note", "get_note", "list_notes", "delete_note"}
    schema = next(t for t in info["tools"] if t["function"]["name"] == "put_note")
    assert schema["function"]["parameters"]["required"] == ["key", "text"]
    bad_json = ToolCall("put_note", "{not json", id="b0")
    unparsed = ToolCall("", "<garbage>", id="b1", parse_error="no JSON object")
    obs, reward, terminated, _, info = env.step(_act(
        bad_json, unparsed, _call("nope", 2), _call("get_note", 3, key="missing"),
        _call("put_note", 4, key=7, text="x")))
    texts = [m.content for m in obs]
    assert not terminated and info["tool_errors"] == 5 and all(t.startswith("Error:") for t in texts)
    assert "not valid JSON" in texts[0] and "could not parse" in texts[1]
    assert "unknown tool 'nope'" in texts[2] and "no note named 'missing'" in texts[3]
    assert "valid string" in texts[4]  # the server's own schema validation
    assert [m.tool_call_id for m in obs] == ["b0", "b1", "c2", "c3", "c4"]
    # calls of one turn run in order on one server, whose state lasts the episode
    obs, *_ = env.step(_act(_call("put_note", 0, key="a", text="1"), _call("get_note", 1, key="a")))
    assert [m.content for m in obs] == ["saved 'a'", "1"]
    obs, *_ = env.step(_act(_call("list_notes")))
    assert obs[0].content == "a"
    assert len(_server_processes(marker)) >= 1
    _, reward, terminated, *_ = env.step("All done.")
    assert terminated and reward == 0.0  # free-form: no reward function
    env.reset(seed=1)  # a new episode gets a new, empty server
    obs, *_ = env.step(_act(_call("list_notes")))
    assert json.loads(obs[0].content) == {"result": []}  # no text blocks: the structured result
    assert len(_server_processes(marker)) >= 1
    env.close()
    env.close()
    deadline = time.monotonic() + 10
    while _server_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _server_processes(marker) == [], "the server outlived env.close()"


async def test_crashing_server_is_a_failed_episode_with_its_error(tokenizer_dir):
    from palaestra.agents import make_agent
    from palaestra.rollout.play import run_episode
    from palaestra.engine import SamplingParams
    from palaestra.engines.clients.scripted import ScriptedEngine

    env = make("palaestra/MCP-v0", command=["python", SERVER, "--crash-on", "boom"])
    tok = make_agent(tokenizer_dir, "qwen").tokenizer
    call = '<tool_call>\n{"name": "get_note", "arguments": {"key": "boom"}}\n</tool_call>'
    engine = ScriptedEngine([*tok.encode(call, add_special_tokens=False),
                             tok.convert_tokens_to_ids("<|im_end|>")])
    agent = make_agent(tokenizer_dir, "qwen", max_context=2048)
    traj = await run_episode(env, agent, engine, SamplingParams(max_new_tokens=64),
                             task={"id": "crash", "prompt": "Read the note boom."})
    assert traj.failed and traj.stop_reason is StopReason.ERROR
    last = traj.turns[-1]
    assert "exited" in last.info["error"] and last.info["mcp_failure"] == "crashed"
    assert last.observation[0].role == "tool" and "exited" in last.observation[0].content
    assert traj.samples, "the failed episode's tokens are kept"
    env.close()


def test_hanging_server_times_out_and_ends_the_episode():
    env = make("palaestra/MCP-v0", command=["python", SERVER, "--hang-on", "slow"],
               tool_timeout_s=1.0)
    env.reset(seed=0)
    began = time.monotonic()
    obs, _, terminated, _, info = env.step(_act(_call("get_note", key="slow")))
    assert time.monotonic() - began < 10
    assert terminated and info["stop_reason"] == "timeout" and info["mcp_failure"] == "timeout"
    assert "did not answer within 1 s" in obs[0].content
    env.close()


PROBE_SERVER = '''
import json, os, socket, sys
try:
    from mcp.server.mcpserver import MCPServer as FastMCP
except ImportError:
    from mcp.server.fastmcp import FastMCP
server = FastMCP("probe")

@server.tool()
def probe(port: int, path: str) -> str:
    """What the server can reach."""
    out = {"env": sorted(os.environ), "cwd": os.getcwd()}
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        out["network"] = "connected"
    except OSError as exc:
        out["network"] = f"blocked: {exc}"
    try:
        with open(path, "w") as f:
            f.write("x")
        out["write"] = "written"
    except OSError as exc:
        out["write"] = f"blocked: {exc}"
    return json.dumps(out)

server.run()
'''


@pytest.mark.parametrize("sandbox", [True, False])
def test_sandboxed_server_sees_no_network_no_secrets_and_cannot_write(tmp_path, monkeypatch,
                                                                      sandbox):
    from palaestra.sandbox.probe import probe_isolation

    if sandbox and not probe_isolation().bwrap:
        pytest.skip("bubblewrap does not work here")
    (tmp_path / "probe_server.py").write_text(PROBE_SERVER)
    target = tmp_path / "written.txt"
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    threading.Thread(target=lambda: listener.accept(), daemon=True).start()
    monkeypatch.setenv("PALAESTRA_TEST_SECRET", "hunter2")
    env = make("palaestra/MCP-v0", command=["python", str(tmp_path / "probe_server.py")],
               sandbox=sandbox)
    env.reset(seed=0)
    obs, *_ = env.step(_act(_call("probe", port=port, path=str(target))))
    seen = json.loads(obs[0].content)
    env.close()
    listener.close()
    assert "PALAESTRA_TEST_SECRET" not in seen["env"]  # a clean environment either way
    if sandbox:
        assert seen["network"].startswith("blocked") and seen["write"].startswith("blocked")
        assert not target.exists() and seen["cwd"] == "/sandbox"
    else:  # the same probe outside the sandbox reaches both: the walls above are real
        assert seen["network"] == "connected" and target.read_text() == "x"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_streamable_http_server_on_loopback():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, SERVER, "--http", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        env = make("palaestra/MCP-v0", url=f"http://127.0.0.1:{port}/mcp")
        _, info = env.reset(seed=0)
        assert "put_note" in {t["function"]["name"] for t in info["tools"]}
        obs, *_ = env.step(_act(_call("put_note", 0, key="k", text="v"),
                                _call("get_note", 1, key="k")))
        assert [m.content for m in obs] == ["saved 'k'", "v"]
        env.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_bad_configuration_says_how_to_fix():
    from palaestra.errors import ConfigError

    with pytest.raises(ConfigError, match="not both"):
        make("palaestra/MCP-v0", command=["python", SERVER], url="http://127.0.0.1:1/mcp")
    with pytest.raises(ConfigError, match="cannot find the server program"):
        make("palaestra/MCP-v0", command=["no-such-program-xyz"])
    with pytest.raises(ConfigError, match="module:function"):
        make("palaestra/MCP-v0", command=["python", SERVER], reward="not-a-path")


TRAIN_REWARD = '''
"""Shaped reward for the MCP training test: the note set up at reset still on the server
(read back through the episode's live server) plus the reply's length (random replies differ)."""


async def note_kept_and_length(episode):
    outcome = await episode.call("get_note", key="seed")
    kept = not outcome.is_error and outcome.text == episode.task["seed_text"]
    return 0.5 * kept + min(len(episode.answer), 40) / 80
'''


@pytest.mark.slow
def test_short_grpo_run_on_a_real_mcp_server(tmp_path, tokenizer_dir, monkeypatch):
    """Two GRPO steps of the real training loop; every episode starts a sandboxed notes server
    (the task's setup call), and its reward is read back from that server."""
    from palaestra.config import load_config
    from palaestra.run.config import TrainConfig
    from palaestra.run.train import train

    (tmp_path / "mcp_train_reward.py").write_text(TRAIN_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    rows = tmp_path / "tasks.jsonl"
    with rows.open("w") as f:
        for i in range(12):
            f.write(json.dumps({"id": f"t{i}", "prompt": f"Say something about note {i}.",
                                "seed_text": f"text {i}", "setup": [
                                    {"name": "put_note", "arguments": {"key": "seed",
                                                                       "text": f"text {i}"}}]}) + "\n")
    config = tmp_path / "run.toml"
    config.write_text(f'''
out = "{tmp_path / "run"}"
seed = 0
[model]
path = "{tokenizer_dir}"
[env]
id = "palaestra/MCP-v0"
kwargs = {{ command = ["python", "{SERVER}"], reward = "mcp_train_reward:note_kept_and_length" }}
[data]
path = "{rows}"
[agent]
max_context = 1536
[rollout]
cluster = "local"
num_workers = 1
max_new_tokens = 64
temperature = 1.0
batch_size = 2
group_size = 2
[engine]
device = "cpu"
[eval]
num_tasks = 2
[trainer]
steps = 2
[trainer.torch]
device = "cpu"
lr = 0.05
pack_sequences = false
[trainer.loss]
preset = "grpo"
[checkpoint]
interval = 2
keep_last = 1
[logging]
progress = false
tensorboard = false
''')
    train(load_config(TrainConfig, config))
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    rl = [r for r in metrics if r.get("phase") == "rl"]
    assert [r["step"] for r in rl] == [0, 1]
    # every episode started its server (the setup call at reset; a failure there would be a
    # failed episode), and each one that answered read the setup note back (0.5 of its reward)
    assert all(r["episodes/failed"] == 0 and r["train/num_loss_tokens"] > 0 for r in rl)
    answered = [r.get("stop_reason/terminated", 0.0) for r in rl]
    assert sum(answered) >= 1, "no episode answered: the reward path was not exercised"
    for r, n in zip(rl, answered):
        assert r["reward_mean"] * 4 >= 0.5 * n, (r["reward_mean"], n)

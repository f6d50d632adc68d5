"""`AgentSpec`, `make_agent`, the tokenizer cache, the public API and the light import."""

from __future__ import annotations

import dataclasses
import inspect
import json
import pickle
import random
import subprocess
import sys

import pytest

import palaestra.agents as agents
from palaestra.agents import Agent, AgentSpec, load_tokenizer, make_agent
from palaestra.errors import ConfigError
from palaestra.types import Message

QUESTION = Message("user", "What is 2 + 2?")


def test_public_api_is_pinned():
    assert set(agents.__all__) == {
        "FAMILIES",
        "Agent",
        "AgentSpec",
        "ChatTemplate",
        "DriftReport",
        "HermesParser",
        "Llama3Parser",
        "Parser",
        "PythonBlockParser",
        "Renderer",
        "SearchR1Parser",
        "TemplateDelta",
        "TemplateDeltaError",
        "TokenTranscript",
        "TurnMarks",
        "compare_ids",
        "extract_answer",
        "get_renderer",
        "load_tokenizer",
        "make_agent",
        "split_reasoning",
    }
    params = inspect.signature(Agent.__init__).parameters
    assert list(params) == [
        "self",
        "tokenizer",
        "renderer",
        "max_context",
        "enable_thinking",
        "drift_check",
        "strict_drift",
        "drift_rate",
        "drift_seed",
    ]
    assert (params["renderer"].default, params["max_context"].default) == ("qwen", 4096)
    for name in (
        "start",
        "on_generation",
        "on_observation",
        "to_sample",
        "drift",
        "remaining_context",
    ):
        assert callable(getattr(Agent, name))
    assert isinstance(Agent.input_ids, property) and isinstance(Agent.stop_token_ids, property)
    assert list(inspect.signature(Agent.to_sample).parameters) == [
        "self",
        "reward",
        "turn_rewards",
        "stop_reason",
        "env_id",
        "task_id",
        "group_id",
    ]
    assert [f.name for f in dataclasses.fields(AgentSpec)] == [
        "tokenizer_path",
        "family",
        "max_context",
        "enable_thinking",
        "drift_rate",
        "strict_drift",
        "chat_template",
        "tools_in_prompt",
    ]
    assert set(agents.FAMILIES) == {"qwen", "llama3", "search_r1", "python", "smollm2"}


def test_spec_pickles_and_builds_with_a_cached_tokenizer(tokenizer_dir):
    spec = AgentSpec(str(tokenizer_dir), "hermes", max_context=512, drift_rate=1.0)
    clone = pickle.loads(pickle.dumps(spec))
    assert clone == spec
    a, b = clone.build(), spec.build()
    assert a.tokenizer is b.tokenizer is load_tokenizer(tokenizer_dir)  # one per process
    assert a is not b and a.renderer.family == "qwen" and a.max_context == 512
    a.start([QUESTION])
    assert a.checks_drift  # drift_rate 1.0: every episode is checked
    never = AgentSpec(str(tokenizer_dir), drift_rate=0.0).build()
    half = AgentSpec(str(tokenizer_dir), drift_rate=0.5).build(random.Random(0))
    checked = []
    for _ in range(200):  # one agent, reused for many episodes: drawn per episode
        never.start([QUESTION])
        half.start([QUESTION])
        assert not never.checks_drift
        checked.append(half.checks_drift)
    assert 60 < sum(checked) < 140
    reseeded = AgentSpec(str(tokenizer_dir), drift_rate=0.5).build(random.Random(0))
    again = []
    for _ in range(200):
        reseeded.start([QUESTION])
        again.append(reseeded.checks_drift)
    assert again == checked  # the rng makes the draws reproducible


def test_spec_validation(tokenizer_dir):
    with pytest.raises(ConfigError, match="unknown agent family"):
        AgentSpec(str(tokenizer_dir), "not-a-family")
    with pytest.raises(ConfigError, match="drift_rate"):
        AgentSpec(str(tokenizer_dir), drift_rate=1.5)
    with pytest.raises(ConfigError, match="does not exist"):
        load_tokenizer("./no/such/dir")


def test_make_agent_from_path_and_template_override(tokenizer, tokenizer_dir):
    from_path = make_agent(tokenizer_dir, "qwen", max_context=256)
    from_obj = make_agent(tokenizer, "qwen", max_context=256)
    from_path.start([QUESTION])
    from_obj.start([QUESTION])
    assert from_path.input_ids == from_obj.input_ids
    plain = make_agent(
        tokenizer,
        "qwen",
        chat_template=(
            "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}"
        ),
    )
    plain.start([QUESTION])
    assert tokenizer.decode(plain.input_ids) == "[user] What is 2 + 2?<|im_end|>[assistant] "
    assert plain.marks.close_text == "<|im_end|>"


def test_spec_builds_the_same_agent_in_another_process(tokenizer_dir, tmp_path):
    spec = AgentSpec(str(tokenizer_dir), "qwen", max_context=256)
    (tmp_path / "spec.pkl").write_bytes(pickle.dumps(spec))
    code = (
        "import json, pickle, sys\n"
        "from palaestra.types import Message\n"
        f"spec = pickle.load(open({str(tmp_path / 'spec.pkl')!r}, 'rb'))\n"
        "agent = spec.build()\n"
        "agent.start([Message('user', 'What is 2 + 2?')])\n"
        "print(json.dumps([agent.input_ids, list(agent.stop_token_ids)]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    ids, stops = json.loads(out.stdout.strip().splitlines()[-1])
    local = spec.build()
    local.start([QUESTION])
    assert ids == local.input_ids and tuple(stops) == local.stop_token_ids


def test_import_is_light():
    code = (
        "import sys, palaestra.agents\n"
        "heavy = [m for m in ('torch', 'transformers', 'ray', 'jinja2', 'palaestra.rollout')"
        " if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_tools_can_stay_out_of_the_prompt(tokenizer_dir):
    from palaestra.agents import AgentSpec
    from palaestra.types import Message

    tools = [{"type": "function", "function": {"name": "calculator", "description": "d", "parameters": {}}}]
    obs = [Message("system", "sys"), Message("user", "q")]
    with_tools = AgentSpec(str(tokenizer_dir)).build()
    with_tools.start(obs, tools)
    without = AgentSpec(str(tokenizer_dir), tools_in_prompt=False).build()
    without.start(obs, tools)
    text = without.tokenizer.decode(without.input_ids)
    assert "# Tools" not in text and "# Tools" in with_tools.tokenizer.decode(with_tools.input_ids)
    assert len(without.input_ids) < len(with_tools.input_ids)

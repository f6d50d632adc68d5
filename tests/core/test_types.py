"""Core types: construction, validation, OpenAI round trip, pickling."""

import pickle

import pytest

from palaestra.errors import TrajectoryValidationError
from palaestra.types import Message, Sample, StopReason, ToolCall, Trajectory, Turn, as_message


def test_message_openai_round_trip():
    msg = Message(
        role="assistant",
        content="calling",
        tool_calls=(ToolCall(name="calculator", arguments='{"expression": "1+2"}', id="c1"),),
    )
    data = msg.to_dict()
    assert data["tool_calls"][0]["function"] == {"name": "calculator", "arguments": '{"expression": "1+2"}'}
    assert Message.from_dict(data) == msg


def test_message_from_dict_accepts_object_arguments_and_parts():
    msg = Message.from_dict(
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "tool_calls": [{"id": "x", "function": {"name": "f", "arguments": {"a": 1}}}],
        }
    )
    assert msg.content == "ab"
    assert msg.tool_calls[0].arguments == '{"a": 1}'


def test_message_rejects_unknown_role_and_non_text():
    with pytest.raises(ValueError, match="unknown message role"):
        Message(role="robot", content="hi")
    with pytest.raises(TypeError, match="must be a str"):
        Message(role="user", content=3)  # type: ignore[arg-type]


def test_as_message_wraps_strings_and_dicts():
    assert as_message("hi") == Message("assistant", "hi")
    assert as_message({"role": "user", "content": "x"}) == Message("user", "x")
    with pytest.raises(TypeError):
        as_message(3)  # type: ignore[arg-type]


def _sample(**kw):
    base = dict(
        token_ids_T=(1, 2, 3, 4),
        loss_mask_T=(0, 0, 1, 1),
        logprobs_T=(0.0, 0.0, -0.5, -1.0),
        versions_T=(-1, -1, 3, 4),
        prompt_len=2,
        reward=1.0,
    )
    base.update(kw)
    return Sample(**base)


def test_sample_lengths_must_agree():
    with pytest.raises(TrajectoryValidationError, match="one entry per token"):
        _sample(loss_mask_T=(0, 1))
    with pytest.raises(TrajectoryValidationError, match="prompt_len"):
        _sample(prompt_len=9)


def test_sample_properties_and_validation():
    s = _sample()
    assert s.num_tokens == 4 and s.num_sampled == 2 and s.min_version == 3
    s.validate(vocab_size=10)
    with pytest.raises(TrajectoryValidationError, match="outside the vocabulary"):
        s.validate(vocab_size=3)
    with pytest.raises(TrajectoryValidationError, match="NaN"):
        _sample(logprobs_T=(0.0, 0.0, float("nan"), -1.0)).validate()
    with pytest.raises(TrajectoryValidationError, match="<= 0"):
        _sample(logprobs_T=(0.0, 0.0, 0.5, -1.0)).validate()
    assert s.with_advantage(0.5).advantage == 0.5 and s.advantage is None


def test_everything_pickles_and_is_frozen():
    s = _sample(metrics={"a": 1.0})
    turn = Turn(action=Message("assistant", "x"), observation=(Message("tool", "y"),), reward=0.5, info={"k": 1})
    traj = Trajectory(
        env_id="e", task_id="t", messages=(Message("user", "q"),), turns=(turn,), samples=(s,),
        reward=1.0, stop_reason=StopReason.TERMINATED, metrics={"m": 2.0},
    )
    back = pickle.loads(pickle.dumps(traj))
    assert back == traj and back.samples[0].metrics == {"a": 1.0}
    with pytest.raises(AttributeError):
        s.reward = 2.0  # type: ignore[misc]
    assert traj.turn_rewards == (0.5,) and not traj.failed
    assert traj.to_json()["stop_reason"] == "terminated"

"""Demonstrations (chat transcripts) -> `Sample`s in exactly the layout the RL agent produces.

SFT must train the tokens the policy will later *sample*: for each assistant turn, the text after
the generation prompt up to and including the end-of-turn token. So a demonstration is replayed
through an `Agent`: every assistant message is rendered the way the template writes it, tokenized
as if the model had sampled it (loss mask 1) and fed through `Agent.on_generation`; every other
message goes through `Agent.on_observation` as a mask-0 delta. The result has the same prompt,
turn boundaries and closing tokens as an RL episode of the same conversation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from palaestra.agents.agent import Agent
from palaestra.engine import Generation
from palaestra.errors import ConfigError
from palaestra.types import Message, Sample, StopReason, as_message


def _assistant_turn_ids(agent: Agent, message: Message) -> tuple[int, ...]:
    """Token ids of ``message`` as the model would sample them after the generation prompt."""
    history = list(agent.messages)
    tokenizer = agent.tokenizer
    prompt = agent.renderer.render(
        tokenizer, history, tools=agent.tools, add_generation_prompt=True,
        enable_thinking=agent.enable_thinking,
    )
    full = agent.renderer.render(
        tokenizer, [*history, message], tools=agent.tools, add_generation_prompt=False,
        enable_thinking=agent.enable_thinking,
    )
    if not full.startswith(prompt):
        raise ConfigError(
            "the chat template does not render an assistant turn as a continuation of the "
            "generation prompt; this template cannot be used for SFT demonstrations"
        )
    turn_text = full[len(prompt):]
    ids = tokenizer.encode(turn_text, add_special_tokens=False)
    stops = set(agent.stop_token_ids)
    end = next((i for i, t in enumerate(ids) if t in stops), None)
    if end is None:
        raise ConfigError("the rendered assistant turn has no end-of-turn token")
    return tuple(ids[: end + 1])


def demonstration_to_sample(
    agent: Agent,
    messages: Sequence[Message | Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] = (),
    *,
    task_id: str = "",
    env_id: str = "",
) -> Sample:
    """Replay one transcript through ``agent``; loss mask 1 exactly on the assistant turns."""
    msgs = [as_message(m, role="user") if not isinstance(m, Message) else m for m in messages]
    first = next((i for i, m in enumerate(msgs) if m.role == "assistant"), None)
    if first is None or first == 0:
        raise ConfigError("a demonstration needs prompt messages followed by an assistant turn")
    agent.start(msgs[:first], tools)
    pending: list[Message] = []
    for message in msgs[first:]:
        if message.role == "assistant":
            if pending:
                if not agent.on_observation(pending):
                    break  # over the context limit: keep what fits
                pending = []
            ids = _assistant_turn_ids(agent, message)
            agent.on_generation(Generation(ids, (0.0,) * len(ids), "stop", weight_version=-1))
        else:
            pending.append(message)
    return agent.to_sample(
        reward=0.0, stop_reason=StopReason.TERMINATED, task_id=task_id, env_id=env_id
    )

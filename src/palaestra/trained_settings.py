"""The settings a model was trained with, recorded beside its export so evaluation reproduces them.

`palaestra train` writes ``RUN/final-model/trained_with.json`` right after exporting the policy:
the agent (chat family, whether tool schemas go into the prompt, context length, thinking, chat
template), the sampling of the run's held-out evaluation (temperature, top-p, top-k, tokens per
turn) and the env (id and kwargs). The format lives in core: the trainer writes it, the
benchmarks read it, and trainers never import benchmarks. ``palaestra eval --model RUN/final-model`` reads it and plays
episodes as that evaluation did, unless a flag overrides a value (``--no-trained-settings``
ignores the file)::

    record_trained_settings(run / "final-model", agent_spec, sampling, env_id=..., env_kwargs=...)
    settings = read_trained_settings("runs/quickstart/final-model")  # None when absent
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from palaestra.engine import SamplingParams
from palaestra.errors import ConfigError

FILENAME = "trained_with.json"
FORMAT = 1


@dataclass(frozen=True)
class TrainedSettings:
    """What evaluation needs to play a trained model's episodes as its training run did."""

    family: str = "qwen"
    tools_in_prompt: bool = True
    max_context: int = 4096
    enable_thinking: bool | None = None
    chat_template: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int | None = None
    env_id: str = ""
    env_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        data = {"format": FORMAT, **asdict(self), "env_kwargs": dict(self.env_kwargs)}
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    def describe(self) -> str:
        """One line for the console: the agent and sampling settings."""
        return (
            f"family={self.family}, tools_in_prompt={self.tools_in_prompt}, "
            f"max_context={self.max_context}, temperature={self.temperature:g}, "
            f"top_p={self.top_p:g}, max_new_tokens={self.max_new_tokens}, env={self.env_id}"
        )


def record_trained_settings(
    model_dir: str | Path,
    agent_spec: Any,
    sampling: SamplingParams,
    *,
    env_id: str,
    env_kwargs: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``trained_with.json`` in ``model_dir`` from the run's `AgentSpec` and the
    `SamplingParams` of its held-out evaluation; returns the file's path."""
    settings = TrainedSettings(
        family=agent_spec.family,
        tools_in_prompt=bool(agent_spec.tools_in_prompt),
        max_context=int(agent_spec.max_context),
        enable_thinking=agent_spec.enable_thinking,
        chat_template=agent_spec.chat_template,
        temperature=float(sampling.temperature),
        top_p=float(sampling.top_p),
        top_k=int(sampling.top_k),
        max_new_tokens=int(sampling.max_new_tokens),
        env_id=env_id,
        env_kwargs=dict(env_kwargs or {}),
    )
    path = Path(model_dir) / FILENAME
    path.write_text(settings.to_json())
    return path


def read_trained_settings(model_dir: str | Path) -> TrainedSettings | None:
    """The settings recorded in ``model_dir`` (None when it has none); a broken file is an error."""
    path = Path(model_dir).expanduser() / FILENAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise TypeError("not a JSON object")
        version = data.pop("format", None)
        if version != FORMAT:
            raise ValueError(f"format {version!r}, expected {FORMAT}")
        return TrainedSettings(**data)
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"{path} is not a valid record of training settings ({exc}); delete it, or pass "
            "--no-trained-settings and give the settings as flags"
        ) from None


__all__ = ["FILENAME", "TrainedSettings", "read_trained_settings", "record_trained_settings"]

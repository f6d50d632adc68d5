"""Apply a benchmark's prompt template and system prompt to any env's first observation.

The env still builds its own first messages from the task (so its parser, tools and reward are
untouched); the benchmark then rewrites them: ``system_prompt`` replaces (or adds) the system
message and ``prompt_template`` rewrites the last user message with `str.format` over the task
row plus ``{prompt}``, the text the env wrote. The override is installed on the env instance, so
`reset`, `areset` and the rollout loop see it without knowing about benchmarks.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from palaestra.errors import ConfigError
from palaestra.types import Message, as_message


def template_fields(template: str) -> set[str]:
    """The top-level field names a `str.format` template uses."""
    names = set()
    for _, name, _, _ in string.Formatter().parse(template):
        if name:
            names.add(name.split(".")[0].split("[")[0])
    return names


def render_prompt(template: str, row: Mapping[str, Any], prompt: str) -> str:
    values = {**row, "prompt": prompt}
    missing = sorted(template_fields(template) - set(values))
    if missing:
        raise ConfigError(
            f"prompt template uses {missing} which the task row lacks (its keys: {sorted(row)}); "
            "use {prompt} for the env's own question text"
        )
    return template.format_map(values)


class _PromptedInitialMessages:
    """Replacement for ``env.initial_messages`` that post-processes the env's own messages."""

    def __init__(
        self,
        original: Callable[[Mapping[str, Any]], Sequence[Message]],
        template: str | None,
        system_prompt: str | None,
    ) -> None:
        self.original = original
        self.template = template
        self.system_prompt = system_prompt

    def __call__(self, task: Mapping[str, Any]) -> list[Message]:
        messages = [as_message(m, role="user") for m in self.original(task)]
        if self.template is not None:
            users = [i for i, m in enumerate(messages) if m.role == "user"]
            if not users:
                raise ConfigError("the env's first observation has no user message to template")
            i = users[-1]
            text = render_prompt(self.template, task, messages[i].content)
            messages[i] = Message(role="user", content=text)
        if self.system_prompt is not None:
            system = Message(role="system", content=self.system_prompt)
            if messages and messages[0].role == "system":
                messages[0] = system
            else:
                messages.insert(0, system)
        return messages


def apply_prompt(env: Any, template: str | None, system_prompt: str | None) -> Any:
    """Install the benchmark's prompt on ``env`` (a no-op when both are None); returns ``env``."""
    if template is None and system_prompt is None:
        return env
    env.initial_messages = _PromptedInitialMessages(env.initial_messages, template, system_prompt)
    return env


__all__ = ["apply_prompt", "render_prompt", "template_fields"]

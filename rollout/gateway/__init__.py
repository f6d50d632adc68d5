"""The agent gateway: train and evaluate any OpenAI-client agent, and take trajectories from
generators that run elsewhere.

- `Gateway` (+ `serve_gateway`): OpenAI-compatible ``/v1/chat/completions`` (tools, streaming)
  and ``/v1/models`` in front of an `Engine`, one session per episode (``/sessions/{id}/v1`` or
  the ``X-Palaestra-Session`` header), recording the exact sampled tokens per session (see
  `palaestra.rollout.gateway.session` for the continuation rule).
- `run_agent_episode`: plays a `palaestra.envs.external_agent.ExternalAgentEnv` episode through the gateway.
- `TrajectoryBuffer` (``POST /trajectories``, strictly validated), `TrajectoryClient`, and
  `BufferSource`: posted groups join the rollout manager's batches like any other group.
- ``palaestra gateway`` (`palaestra.rollout.gateway.cli`): the server in front of engine URLs.

Importing this package is light: names load on first use (aiohttp and the tokenizer only when a
gateway is built).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the lazy exports for type checkers; at run time `__getattr__` loads them
    from palaestra.rollout.gateway.agent_episode import (
        close_gateways as close_gateways,
    )
    from palaestra.rollout.gateway.agent_episode import (
        gateway_for as gateway_for,
    )
    from palaestra.rollout.gateway.agent_episode import (
        run_agent_episode as run_agent_episode,
    )
    from palaestra.rollout.gateway.batches import (
        samples_of_groups as samples_of_groups,
    )
    from palaestra.rollout.gateway.buffer import (
        TrajectoryBuffer as TrajectoryBuffer,
    )
    from palaestra.rollout.gateway.client import (
        TrajectoryClient as TrajectoryClient,
    )
    from palaestra.rollout.gateway.external import (
        EXTERNAL_ENV as EXTERNAL_ENV,
    )
    from palaestra.rollout.gateway.external import (
        BufferSource as BufferSource,
    )
    from palaestra.rollout.gateway.gateway import (
        Completion as Completion,
    )
    from palaestra.rollout.gateway.gateway import (
        Gateway as Gateway,
    )
    from palaestra.rollout.gateway.server import (
        SESSION_HEADER as SESSION_HEADER,
    )
    from palaestra.rollout.gateway.server import (
        RunningGateway as RunningGateway,
    )
    from palaestra.rollout.gateway.server import (
        serve_gateway as serve_gateway,
    )
    from palaestra.rollout.gateway.session import (
        GatewayError as GatewayError,
    )
    from palaestra.rollout.gateway.session import (
        Session as Session,
    )
    from palaestra.rollout.gateway.template import (
        ChatTokens as ChatTokens,
    )

_EXPORTS = {
    "Gateway": "palaestra.rollout.gateway.gateway",
    "Completion": "palaestra.rollout.gateway.gateway",
    "Session": "palaestra.rollout.gateway.session",
    "GatewayError": "palaestra.rollout.gateway.session",
    "ChatTokens": "palaestra.rollout.gateway.template",
    "serve_gateway": "palaestra.rollout.gateway.server",
    "RunningGateway": "palaestra.rollout.gateway.server",
    "SESSION_HEADER": "palaestra.rollout.gateway.server",
    "run_agent_episode": "palaestra.rollout.gateway.agent_episode",
    "gateway_for": "palaestra.rollout.gateway.agent_episode",
    "close_gateways": "palaestra.rollout.gateway.agent_episode",
    "TrajectoryBuffer": "palaestra.rollout.gateway.buffer",
    "TrajectoryClient": "palaestra.rollout.gateway.client",
    "BufferSource": "palaestra.rollout.gateway.external",
    "EXTERNAL_ENV": "palaestra.rollout.gateway.external",
    "samples_of_groups": "palaestra.rollout.gateway.batches",
}

__all__ = [
    "EXTERNAL_ENV",
    "SESSION_HEADER",
    "BufferSource",
    "ChatTokens",
    "Completion",
    "Gateway",
    "GatewayError",
    "RunningGateway",
    "Session",
    "TrajectoryBuffer",
    "TrajectoryClient",
    "close_gateways",
    "gateway_for",
    "run_agent_episode",
    "samples_of_groups",
    "serve_gateway",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'palaestra.rollout.gateway' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

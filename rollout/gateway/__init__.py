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

Import names from their modules (``palaestra.rollout.gateway.server`` and so on); this package
exports nothing, so importing it is light (aiohttp and the tokenizer load when a gateway is
built).
"""

from __future__ import annotations

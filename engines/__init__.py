"""Generation engines: token ids in, token ids + logprobs out (the `Engine` protocol is core's,
`palaestra.engine`).

- `LocalEngine` (embedded; CPU or CUDA): own generation loop, continuous batching, prefix reuse,
  exact logprobs, in-process weight updates. ``palaestra serve`` puts it behind SGLang's native
  HTTP API and an OpenAI-compatible API.
- `SGLangEngine` / `SGLangClient`: SGLang servers (launched or attached) over that native API.
- `Router`: least-outstanding routing with sticky sessions and failover over several engines.
- `OpenAIEngine`: API models at the message level, for evaluation (not token-exact).

Importing this package is light: the engines load torch, transformers or aiohttp when built.
"""

from __future__ import annotations

from palaestra.engine import (
    Engine,
    EngineUnavailableError,
    Generation,
    SamplingParams,
)

__all__ = [
    "Engine",
    "EngineUnavailableError",
    "Generation",
    "SamplingParams",
]

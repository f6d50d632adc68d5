"""Generation engines: token ids in, token ids + logprobs out (`Engine` protocol in `base`).

- `LocalEngine` (embedded; CPU or CUDA): own generation loop, continuous batching, prefix reuse,
  exact logprobs, in-process weight updates. ``palaestra serve`` puts it behind SGLang's native
  HTTP API and an OpenAI-compatible API.
- `SGLangEngine` / `SGLangClient`: SGLang servers (launched or attached) over that native API.
- `Router`: least-outstanding routing with sticky sessions and failover over several engines.
- `OpenAIEngine`: API models at the message level, for evaluation (not token-exact).

Importing this package is light: the engines load torch, transformers or aiohttp when built.
"""

from __future__ import annotations

import importlib
from typing import Any

from palaestra.rollout.engines.base import (
    Engine,
    EngineUnavailableError,
    Generation,
    SamplingParams,
)

_LAZY = {
    "LocalEngine": "palaestra.rollout.engines.local",
    "StreamChunk": "palaestra.rollout.engines.local",
    "SGLangClient": "palaestra.rollout.engines.sglang",
    "SGLangEngine": "palaestra.rollout.engines.sglang",
    "SGLangServerConfig": "palaestra.rollout.engines.sglang",
    "Router": "palaestra.rollout.engines.router",
    "OpenAIEngine": "palaestra.rollout.engines.openai_engine",
    "token_logprobs": "palaestra.rollout.engines.sampling",
    "ScriptedEngine": "palaestra.rollout.engines.scripted",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = ["Engine", "EngineUnavailableError", "Generation", "SamplingParams", *sorted(_LAZY)]

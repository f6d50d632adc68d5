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
from typing import TYPE_CHECKING, Any

from palaestra.rollout.engines.base import (
    Engine,
    EngineUnavailableError,
    Generation,
    SamplingParams,
)

if TYPE_CHECKING:  # the lazy exports for type checkers; at run time `__getattr__` loads them
    from palaestra.rollout.engines.local import (
        LocalEngine as LocalEngine,
    )
    from palaestra.rollout.engines.local import (
        StreamChunk as StreamChunk,
    )
    from palaestra.rollout.engines.openai_engine import (
        OpenAIEngine as OpenAIEngine,
    )
    from palaestra.rollout.engines.router import (
        Router as Router,
    )
    from palaestra.rollout.engines.sampling import (
        token_logprobs as token_logprobs,
    )
    from palaestra.rollout.engines.scripted import (
        ScriptedEngine as ScriptedEngine,
    )
    from palaestra.rollout.engines.sglang import (
        SGLangClient as SGLangClient,
    )
    from palaestra.rollout.engines.sglang import (
        SGLangEngine as SGLangEngine,
    )
    from palaestra.rollout.engines.sglang import (
        SGLangServerConfig as SGLangServerConfig,
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
